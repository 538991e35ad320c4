//! The metadata store: what the daemon knows about sandboxes, snapshots and
//! templates, and an append-only journal of every transition.
//!
//! [`Store`] has two implementations: [`sqlite`], the embedded default, and
//! [`postgres`], selected by `[store] url = "postgres://…"` (docs/store.md). Methods are synchronous (they block on disk I/O): async
//! callers run them on the blocking pool (see `service::Service::db`).
//! Every write method is one transaction, durable when it returns.
//!
//! The shape is decided for several writers (many hosts on one PostgreSQL):
//! the trait stays synchronous and runs on the blocking pool (a PostgreSQL
//! store implements it over a pooled synchronous client; one transaction per
//! method, as here), and every sandbox update is a compare-and-set on the
//! record's `version` (`UPDATE … WHERE id = $1 AND version = $2`): a writer
//! holding an older copy gets [`StoreError::Stale`] and changes nothing, so
//! no update is ever lost. The service's transition writer
//! (`service::journal`) is the only code that writes a sandbox's state.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState, SnapshotId, TemplateId};

pub mod hosts;
pub mod journal;
pub mod postgres;
pub mod sqlite;

pub use hosts::{Fence, HostError, HostInfo, HostLoad, HostRecord, HostStore, OwnerLease, Replica};
pub use journal::*;

pub use postgres::{PgOptions, PgStore};
pub use sqlite::SqliteStore;

/// The tenant every resource belongs to until tenants exist.
pub const DEFAULT_TENANT: &str = "default";

/// What a sandbox does at its idle timeout, and whether guest traffic wakes
/// it from hibernation (kept beside the record, table `sandbox_lifecycle`,
/// schema 8; inherited by forks). The default is the daemon's historical
/// behaviour: hibernate, and wake on any use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecyclePolicy {
    /// What the idle timeout does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Whether an exec, a file call or port traffic wakes the sandbox from
    /// hibernation; `false`: only an explicit resume (E2B `connect`) does.
    #[serde(default = "auto_resume_default")]
    pub auto_resume: bool,
}

fn auto_resume_default() -> bool {
    true
}

impl Default for LifecyclePolicy {
    fn default() -> Self {
        LifecyclePolicy {
            on_timeout: OnTimeout::Hibernate,
            auto_resume: true,
        }
    }
}

/// One sandbox holding (or about to hold) a VM: [`Store::reserved_sandboxes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedSandbox {
    /// The sandbox.
    pub id: SandboxId,
    /// Its size.
    pub size: SandboxSize,
    /// Its state.
    pub state: SandboxState,
    /// Its pending operation, if any.
    pub pending_op: Option<Op>,
    /// Its last recorded activity (written lazily; the scheduler has the
    /// exact time).
    pub last_activity_at: DateTime<Utc>,
}

/// What a sandbox's idle timeout does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Hibernate (memory kept; the sandbox wakes later).
    #[default]
    Hibernate,
    /// Delete the sandbox and its snapshots (E2B `on_timeout: kill`).
    Delete,
    /// Hibernate without memory (E2B `on_timeout: {action: pause,
    /// keep_memory: false}`): file systems synced and frozen, a disk-only
    /// snapshot, the VM ended; the wake cold-boots from the disk.
    HibernateDisk,
}

impl OnTimeout {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Hibernate => "hibernate",
            OnTimeout::Delete => "delete",
            OnTimeout::HibernateDisk => "hibernate_disk",
        }
    }
}

/// A sandbox as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Id.
    pub id: SandboxId,
    /// Owning tenant.
    pub tenant: String,
    /// Template it was created from, if any.
    pub template: Option<TemplateId>,
    /// Snapshot it was forked from, if any.
    pub source_snapshot: Option<SnapshotId>,
    /// Size.
    pub size: SandboxSize,
    /// User labels.
    pub labels: BTreeMap<String, String>,
    /// Present (last acknowledged) state.
    pub state: SandboxState,
    /// Why it is in that state, when not obvious (failure reasons).
    pub state_reason: Option<String>,
    /// An operation started and not yet finished (recorded before acting).
    pub pending_op: Option<Op>,
    /// Idle timeout in seconds (`None` = daemon default, `Some(0)` = never).
    pub idle_timeout_s: Option<u64>,
    /// Rolling snapshot interval in seconds (`None` = daemon default, `Some(0)` = off).
    pub snapshot_interval_s: Option<u64>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change of the record.
    pub updated_at: DateTime<Utc>,
    /// Last API activity (persisted lazily, at most every few seconds).
    pub last_activity_at: DateTime<Utc>,
    /// VM process id while it has one.
    pub pid: Option<u32>,
    /// Accelerator of its VM.
    pub accel: Option<String>,
    /// When it was deleted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Write version: every update is a compare-and-set on it (an update
    /// from an older copy is refused with [`StoreError::Stale`]).
    #[serde(default)]
    pub version: u64,
}

/// Why a snapshot was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    /// Asked for by a user.
    Manual,
    /// Taken by the rolling schedule.
    Rolling,
    /// The state before a rewind (so the rewind can be undone).
    PreRewind,
    /// The point a rewind returned the sandbox to: a `same_as` record of
    /// the rewind's target, newer than the `pre_rewind` snapshot, so the
    /// restore point (crash recovery, wake) and the history both say the
    /// sandbox has been in the target's state since the rewind.
    Rewind,
    /// Taken when the sandbox hibernated.
    Hibernate,
    /// The implicit snapshot of a fork from a live sandbox.
    Fork,
    /// A template's snapshot.
    Template,
}

impl SnapshotKind {
    /// The snake_case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            SnapshotKind::Manual => "manual",
            SnapshotKind::Rolling => "rolling",
            SnapshotKind::PreRewind => "pre_rewind",
            SnapshotKind::Rewind => "rewind",
            SnapshotKind::Hibernate => "hibernate",
            SnapshotKind::Fork => "fork",
            SnapshotKind::Template => "template",
        }
    }

    /// Parses [`SnapshotKind::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        [
            SnapshotKind::Manual,
            SnapshotKind::Rolling,
            SnapshotKind::PreRewind,
            SnapshotKind::Rewind,
            SnapshotKind::Hibernate,
            SnapshotKind::Fork,
            SnapshotKind::Template,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotStatus {
    /// Recorded, being taken; never usable.
    Pending,
    /// Complete and usable.
    Ready,
    /// Deleted (by the user, by GC, or rolled back).
    Deleted,
}

impl SnapshotStatus {
    /// The snake_case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            SnapshotStatus::Pending => "pending",
            SnapshotStatus::Ready => "ready",
            SnapshotStatus::Deleted => "deleted",
        }
    }

    /// Parses [`SnapshotStatus::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(SnapshotStatus::Pending),
            "ready" => Some(SnapshotStatus::Ready),
            "deleted" => Some(SnapshotStatus::Deleted),
            _ => None,
        }
    }
}

/// A snapshot as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Id.
    pub id: SnapshotId,
    /// Owning tenant.
    pub tenant: String,
    /// The sandbox it is a point of.
    pub sandbox_id: SandboxId,
    /// Why it was taken.
    pub kind: SnapshotKind,
    /// User label.
    pub label: Option<String>,
    /// Pending, ready or deleted.
    pub status: SnapshotStatus,
    /// Why it was deleted or failed.
    pub status_reason: Option<String>,
    /// When it was taken (the guest's point in time).
    pub created_at: DateTime<Utc>,
    /// vCPU pause it cost, in ms.
    pub pause_ms: Option<f64>,
    /// Bytes only it holds.
    pub exclusive_bytes: Option<u64>,
    /// Bytes it references.
    pub referenced_bytes: Option<u64>,
    /// Pool bytes it is charged for quotas: what it holds that the snapshot
    /// it descends from does not (`None`: not computed yet). Read from the
    /// store's charge cache; writing a record never changes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charge_bytes: Option<u64>,
    /// A rolling snapshot of a guest that had not changed since its
    /// previous ready snapshot is recorded without being taken: no pause,
    /// no subvolume, this names the snapshot it is the same as (always a
    /// real one, never another `same_as` record). Rewind, restore and fork
    /// of this record use that snapshot (`service::unchanged`). Schema 12;
    /// `None` for every real snapshot and every row from before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_as: Option<SnapshotId>,
}

/// Template build status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateStatus {
    /// Being built.
    Building,
    /// Usable.
    Ready,
    /// The build failed (see reason).
    Failed,
    /// Deleted.
    Deleted,
    /// The cached state after one step of a recipe build (its owner's next
    /// build of a recipe with the same steps so far resumes from it). Not
    /// listed and not usable as a template: the service answers for it
    /// like an unknown id.
    Step,
}

impl TemplateStatus {
    /// The snake_case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            TemplateStatus::Building => "building",
            TemplateStatus::Ready => "ready",
            TemplateStatus::Failed => "failed",
            TemplateStatus::Deleted => "deleted",
            TemplateStatus::Step => "step",
        }
    }

    /// Parses [`TemplateStatus::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "building" => Some(TemplateStatus::Building),
            "ready" => Some(TemplateStatus::Ready),
            "failed" => Some(TemplateStatus::Failed),
            "deleted" => Some(TemplateStatus::Deleted),
            "step" => Some(TemplateStatus::Step),
            _ => None,
        }
    }
}

/// A template as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRecord {
    /// Id.
    pub id: TemplateId,
    /// Owning tenant.
    pub tenant: String,
    /// Human name (unique among live templates is not enforced).
    pub name: Option<String>,
    /// Size its guest was booted with (the default size of its sandboxes).
    pub size: SandboxSize,
    /// Build status.
    pub status: TemplateStatus,
    /// Why it failed.
    pub status_reason: Option<String>,
    /// Accelerator it was made under.
    pub accel: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The template this one is a size variant of (its disk booted at
    /// another vCPU count and memory, `service::variants`): not listed, used
    /// by creates of that size; deleted with its template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant_of: Option<TemplateId>,
}

/// Phase of a journaled transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventPhase {
    /// Recorded before acting.
    Pending,
    /// Finished; the new state is acknowledged.
    Done,
    /// Failed; the previous state stands.
    Failed,
    /// Found by recovery (rolled back or completed after a crash).
    Recovered,
}

impl EventPhase {
    /// The snake_case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            EventPhase::Pending => "pending",
            EventPhase::Done => "done",
            EventPhase::Failed => "failed",
            EventPhase::Recovered => "recovered",
        }
    }
}

/// One entry of the append-only journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the journal (assigned by the store; 0 before insert).
    pub seq: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Tenant of the sandbox.
    pub tenant: String,
    /// Sandbox concerned.
    pub sandbox_id: SandboxId,
    /// Operation.
    pub op: Op,
    /// State before.
    pub from_state: Option<SandboxState>,
    /// State after (the same as before for a failed op).
    pub to_state: Option<SandboxState>,
    /// Phase.
    pub phase: EventPhase,
    /// Details (failure reason, snapshot id, ...).
    pub detail: Option<String>,
}

impl Event {
    /// An event about `rec` (from its present state) for `op`.
    pub fn new(
        rec: &SandboxRecord,
        op: Op,
        to: Option<SandboxState>,
        phase: EventPhase,
        detail: Option<String>,
        at: DateTime<Utc>,
    ) -> Self {
        Event {
            seq: 0,
            at,
            tenant: rec.tenant.clone(),
            sandbox_id: rec.id.clone(),
            op,
            from_state: Some(rec.state),
            to_state: to,
            phase,
            detail,
        }
    }
}

/// Filters and page of a sandbox listing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxFilter {
    /// Tenant whose sandboxes are listed.
    pub tenant: String,
    /// Only these states (empty: every state but `deleted`).
    pub states: Vec<SandboxState>,
    /// Only sandboxes carrying all these labels.
    pub labels: BTreeMap<String, String>,
    /// Page size (clamped to 1..=1000).
    pub limit: usize,
    /// Opaque cursor from the previous page.
    pub cursor: Option<String>,
}

/// One page of results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The items.
    pub items: Vec<T>,
    /// Cursor of the next page, when there is one.
    pub next_cursor: Option<String>,
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed.
    #[error("database error")]
    Db(#[from] rusqlite::Error),
    /// A stored value does not parse (corruption or a newer schema).
    #[error("corrupt record {table}/{id}: {what}")]
    Corrupt {
        /// Table.
        table: &'static str,
        /// Row id.
        id: String,
        /// What failed to parse.
        what: String,
    },
    /// A pagination cursor that this store did not hand out.
    #[error("invalid cursor")]
    BadCursor,
    /// An update from an older copy of the record than the stored one:
    /// another writer changed it meanwhile; nothing was written.
    #[error("sandbox {id} changed meanwhile (version {expected} expected, {found} stored)")]
    Stale {
        /// The sandbox.
        id: String,
        /// The version the writer read.
        expected: u64,
        /// The version stored.
        found: u64,
    },
    /// The database was written by a newer stratad.
    #[error("database schema version {found} is newer than this stratad ({supported})")]
    TooNew {
        /// Version in the file.
        found: i64,
        /// Newest version known here.
        supported: i64,
    },
    /// Opening the database file failed.
    #[error("cannot open {path}")]
    Open {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A blocking task failed to run.
    #[error("store task failed: {0}")]
    Task(String),
    /// PostgreSQL refused or failed a statement (a constraint, a type, a
    /// serialization failure): the transaction was rolled back.
    #[error("database error: {0}")]
    Pg(String),
    /// The database cannot be reached, or did not answer in time (the
    /// connection was lost, the pool had no connection, a statement
    /// outlived its timeout). Nothing is known to have been written when a
    /// call fails so (a lost commit may have landed: read again).
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// PostgreSQL's disk is full (SQLSTATE 53100): nothing was written; the
    /// write can succeed once space is freed.
    #[error("database full: {0}")]
    Full(String),
    /// Cluster mode (`crate::cluster`): this host does not hold the
    /// sandbox's owner lease (another host owns it, or this host's lease
    /// expired or was taken over); nothing was written.
    #[error("sandbox {sandbox} is not owned by this host ({host}): {why}")]
    Fenced {
        /// The sandbox.
        sandbox: String,
        /// This host.
        host: String,
        /// Who owns it instead, or why the lease is not this host's.
        why: String,
    },
}

impl StoreError {
    /// True when the database's file system has no room left (SQLite's
    /// `SQLITE_FULL`, PostgreSQL's `disk_full`): the write was not made; it can succeed once space
    /// is freed.
    pub fn is_full(&self) -> bool {
        let db = match self {
            StoreError::Db(e) | StoreError::Open { source: e, .. } => e,
            StoreError::Full(_) => return true,
            _ => return false,
        };
        matches!(db, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
    }

    /// True when the database could not be reached or did not answer in
    /// time ([`StoreError::Unavailable`]): the API answers
    /// `storage_failed` (503), a client may retry.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// Result of store calls.
pub type StoreResult<T> = Result<T, StoreError>;

/// Counts for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreCounts {
    /// Sandboxes per state (deleted excluded).
    pub sandboxes_by_state: BTreeMap<String, u64>,
    /// Ready snapshots.
    pub snapshots_ready: u64,
    /// Ready templates.
    pub templates_ready: u64,
}

/// What one snapshot is charged in its lineage: the bytes it holds that the
/// snapshot it descends from (`base`) does not. A snapshot never changes, so
/// its charge is computed once per base and cached here; a new base (the one
/// before was deleted) means a new computation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotCharge {
    /// The snapshot.
    pub snapshot_id: SnapshotId,
    /// Its tenant.
    pub tenant: String,
    /// Its sandbox.
    pub sandbox_id: SandboxId,
    /// What it was compared with: a snapshot id, a template id, or empty
    /// (nothing: every byte it holds).
    pub base: String,
    /// Bytes charged.
    pub bytes: u64,
    /// When it was computed.
    pub computed_at: DateTime<Utc>,
}

/// What a tenant holds, for its quotas (`service::admission`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantUsage {
    /// Sandboxes not deleted.
    pub sandboxes: u64,
    /// vCPUs of its sandboxes with (or starting) a VM.
    pub vcpus: u64,
    /// Memory (MiB) of its sandboxes with (or starting) a VM.
    pub memory_mib: u64,
}

/// Durable records of one control plane. Implementations are shared between
/// threads; each write is atomic and durable when it returns.
pub trait Store: Send + Sync + 'static {
    /// Inserts a new sandbox and its first journal event.
    fn insert_sandbox(&self, rec: &SandboxRecord, event: &Event) -> StoreResult<()>;
    /// Replaces a sandbox record and appends `event`, atomically.
    fn update_sandbox(&self, rec: &SandboxRecord, event: Option<&Event>) -> StoreResult<()>;
    /// Records API activity (no journal entry).
    fn touch_sandbox(&self, id: &SandboxId, at: DateTime<Utc>) -> StoreResult<()>;
    /// One sandbox (deleted ones too).
    fn get_sandbox(&self, id: &SandboxId) -> StoreResult<Option<SandboxRecord>>;
    /// A filtered page, oldest first.
    fn list_sandboxes(&self, filter: &SandboxFilter) -> StoreResult<Page<SandboxRecord>>;
    /// vCPUs and MiB of memory held by sandboxes with a VM (creating,
    /// running, paused) or starting one (a pending resume, rewind or
    /// recover: the reservation of `service::admission`).
    fn reserved_capacity(&self) -> StoreResult<(u64, u64)>;
    /// The sandboxes [`Store::reserved_capacity`] counts (a VM, or a
    /// pending operation that starts one), each with its size and state,
    /// for admission by use and the pressure monitor.
    fn reserved_sandboxes(&self) -> StoreResult<Vec<ReservedSandbox>>;
    /// Every sandbox not deleted (recovery, scheduler start).
    fn live_sandboxes(&self) -> StoreResult<Vec<SandboxRecord>>;
    /// Replaces the environment variables kept with sandbox `id`, as the
    /// service sealed them (opaque here; `None`: none). Deleting the
    /// sandbox deletes them.
    fn put_sandbox_env(&self, id: &SandboxId, sealed: Option<&str>) -> StoreResult<()>;
    /// The stored (sealed) environment of every sandbox not deleted; rows
    /// from before sealing hold plain JSON.
    fn sandbox_envs(&self) -> StoreResult<Vec<(SandboxId, String)>>;
    /// Keeps sandbox `id`'s lifecycle policy (only for a sandbox not
    /// deleted; deleting the sandbox deletes it).
    fn put_sandbox_lifecycle(&self, id: &SandboxId, policy: &LifecyclePolicy) -> StoreResult<()>;
    /// Sandbox `id`'s lifecycle policy; `None`: the default.
    fn sandbox_lifecycle(&self, id: &SandboxId) -> StoreResult<Option<LifecyclePolicy>>;
    /// Replaces a front door's setting `key` of sandbox `id` (JSON text;
    /// `None`: removes it). Only for a sandbox not deleted; deleting the
    /// sandbox deletes its settings.
    fn put_sandbox_setting(
        &self,
        id: &SandboxId,
        key: &str,
        value: Option<&str>,
    ) -> StoreResult<()>;
    /// Setting `key` of every sandbox not deleted that has it.
    fn sandbox_settings(&self, key: &str) -> StoreResult<Vec<(SandboxId, String)>>;
    /// Setting `key` of sandbox `id` (one point read; the default scans
    /// [`Store::sandbox_settings`]).
    fn sandbox_setting(&self, id: &SandboxId, key: &str) -> StoreResult<Option<String>> {
        Ok(self
            .sandbox_settings(key)?
            .into_iter()
            .find(|(s, _)| s == id)
            .map(|(_, v)| v))
    }
    /// Replaces a front door's setting `key` of tenant `tenant` (JSON text;
    /// `None`: removes it), e.g. the E2B door's template tags of a name.
    fn put_tenant_setting(&self, tenant: &str, key: &str, value: Option<&str>) -> StoreResult<()>;
    /// Every tenant's settings whose key starts with `prefix`: (tenant,
    /// key, value).
    fn tenant_settings(&self, prefix: &str) -> StoreResult<Vec<(String, String, String)>>;
    /// Setting `key` of tenant `tenant` (one point read; the default scans
    /// [`Store::tenant_settings`]).
    fn tenant_setting(&self, tenant: &str, key: &str) -> StoreResult<Option<String>> {
        Ok(self
            .tenant_settings(key)?
            .into_iter()
            .find(|(t, k, _)| t == tenant && k == key)
            .map(|(_, _, v)| v))
    }

    /// Inserts or replaces a snapshot record.
    fn put_snapshot(&self, rec: &SnapshotRecord) -> StoreResult<()>;
    /// Writes a sandbox, snapshot records and an event in one transaction.
    fn commit(
        &self,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> StoreResult<()>;
    /// One snapshot.
    fn get_snapshot(&self, id: &SnapshotId) -> StoreResult<Option<SnapshotRecord>>;
    /// A sandbox's snapshots, oldest first (`deleted` ones only when asked).
    fn list_snapshots(
        &self,
        sandbox: &SandboxId,
        include_deleted: bool,
    ) -> StoreResult<Vec<SnapshotRecord>>;
    /// Every snapshot left `pending` (recovery).
    fn pending_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>>;
    /// The newest ready snapshot of a sandbox.
    fn latest_ready_snapshot(&self, sandbox: &SandboxId) -> StoreResult<Option<SnapshotRecord>>;
    /// The newest ready snapshot of a sandbox taken at or before `at`.
    fn ready_snapshot_at(
        &self,
        sandbox: &SandboxId,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<SnapshotRecord>>;
    /// Every ready snapshot id (recovery checks them against the pool).
    fn ready_snapshot_ids(&self) -> StoreResult<Vec<SnapshotId>>;
    /// Ids of sandboxes with ready snapshots, after `after`, at most `limit` (GC sweep).
    fn sandboxes_with_snapshots(
        &self,
        after: Option<&SandboxId>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxId>>;

    /// Inserts or replaces a template.
    fn put_template(&self, rec: &TemplateRecord) -> StoreResult<()>;
    /// One template.
    fn get_template(&self, id: &TemplateId) -> StoreResult<Option<TemplateRecord>>;
    /// Templates not deleted of one owner, oldest first.
    fn list_templates(&self, tenant: &str) -> StoreResult<Vec<TemplateRecord>>;
    /// Every template not deleted, whoever owns it, oldest first.
    fn all_templates(&self) -> StoreResult<Vec<TemplateRecord>>;

    /// The journal of a sandbox, newest last, at most `limit` entries.
    fn events(&self, sandbox: &SandboxId, limit: usize) -> StoreResult<Vec<Event>>;
    /// Counts for metrics and stats, of one tenant or (`None`) of all.
    fn counts(&self, tenant: Option<&str>) -> StoreResult<StoreCounts>;

    /// What `tenant` holds: sandboxes not deleted; vCPUs and memory counted
    /// as [`Store::reserved_capacity`] counts them.
    fn tenant_usage(&self, tenant: &str) -> StoreResult<TenantUsage>;
    /// The ready snapshots of `tenant`, by sandbox, oldest first.
    fn tenant_ready_snapshots(&self, tenant: &str) -> StoreResult<Vec<SnapshotRecord>>;
    /// The cached charges of `tenant`'s ready snapshots.
    fn snapshot_charges(&self, tenant: &str) -> StoreResult<Vec<SnapshotCharge>>;
    /// Records (or replaces) a snapshot's charge.
    fn put_charge(&self, charge: &SnapshotCharge) -> StoreResult<()>;

    /// Appends a journal entry of a kind other than `sandbox` and queues
    /// one delivery of it to each webhook of its tenant subscribed to its
    /// topic (at most [`Store::set_delivery_limit`] pending per tenant;
    /// beyond, none is queued), in one transaction. Returns its `seq`.
    fn append_journal(&self, note: &JournalNote) -> StoreResult<i64>;
    /// The journal of `tenant` after `after` (of one sandbox when given),
    /// oldest first, at most `limit` entries.
    fn journal_after(
        &self,
        tenant: &str,
        sandbox: Option<&str>,
        after: i64,
        limit: usize,
    ) -> StoreResult<Vec<JournalEntry>>;
    /// A receiver that changes after every commit that appended to the
    /// journal (the value is a counter, not a seq: read the store).
    fn journal_changes(&self) -> tokio::sync::watch::Receiver<u64>;
    /// Deletes journal entries older than `before`, and deliveries no
    /// longer pending older than it. Returns the entries deleted.
    fn prune_journal(&self, before: DateTime<Utc>) -> StoreResult<u64>;
    /// Most pending deliveries per tenant (default 1000).
    fn set_delivery_limit(&self, limit: usize);

    /// Inserts a webhook.
    fn put_webhook(&self, hook: &Webhook) -> StoreResult<()>;
    /// The webhooks of `tenant` (not deleted), oldest first.
    fn webhooks(&self, tenant: &str) -> StoreResult<Vec<Webhook>>;
    /// One webhook of `tenant` (not deleted).
    fn get_webhook(&self, tenant: &str, id: &str) -> StoreResult<Option<Webhook>>;
    /// Deletes webhook `id` of `tenant` and cancels its pending
    /// deliveries; `false`: no such webhook.
    fn delete_webhook(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> StoreResult<bool>;
    /// Pending deliveries due at `now`, oldest first, at most `limit`.
    fn due_deliveries(&self, now: DateTime<Utc>, limit: usize) -> StoreResult<Vec<Delivery>>;
    /// When the next pending delivery is due.
    fn next_delivery_at(&self) -> StoreResult<Option<DateTime<Utc>>>;
    /// Records an attempt's outcome (status, attempts, error, next time).
    fn update_delivery(&self, d: &Delivery) -> StoreResult<()>;
    /// The deliveries of webhook `id`, newest first, at most `limit`.
    fn deliveries(&self, webhook: &str, limit: usize) -> StoreResult<Vec<Delivery>>;
}

#[cfg(test)]
pub(crate) mod tests;
