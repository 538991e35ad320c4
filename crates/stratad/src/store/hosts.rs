//! Hosts and sandbox ownership (issue 17). The daemon uses it through
//! `crate::cluster` (`[cluster] enabled`, docs/cluster.md).
//!
//! Each `stratad` registers itself ([`HostStore::register_host`]) and
//! heartbeats ([`HostStore::heartbeat`]); a registration starts a new
//! *epoch* of the host id, so the process it replaces (a restarted daemon's
//! predecessor, still running somewhere) can no longer heartbeat.
//!
//! Every sandbox has at most one owner, held by a lease with a **fencing
//! token** ([`OwnerLease`]): a number taken from one sequence, strictly
//! larger for every new grant, whoever gets it. A lease is taken over only
//! after it expired (plus a margin), judged by the database's clock, never
//! a host's. Writes of an owner go through [`HostStore::commit_fenced`],
//! which checks, in the write's own transaction, that the lease is still
//! the one the writer holds (same host, same token, not expired): a stale
//! owner's write is refused with [`HostError::Fenced`] and changes nothing.
//!
//! Only PostgreSQL implements it (one SQLite file serves one host).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use strata_core::SandboxId;

use super::{Event, SandboxRecord, SnapshotRecord, StoreError};

/// What a host says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// Stable id (e.g. the machine's name).
    pub id: String,
    /// Where the other hosts reach its API.
    pub address: String,
    /// Accelerator (`kvm`, `tcg`).
    pub accel: String,
    /// QEMU version.
    pub qemu_version: String,
    /// CPU model (moves between hosts need compatible ones).
    pub cpu_model: String,
    /// Capacity.
    pub capacity: HostLoad,
}

/// CPU, memory and pool bytes (a capacity, or what is free of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostLoad {
    /// vCPUs.
    pub vcpus: u64,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Pool bytes.
    pub pool_bytes: u64,
}

/// A host as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    /// What it registered.
    pub info: HostInfo,
    /// What it last reported free.
    pub free: HostLoad,
    /// Its registration's epoch (one more at every registration).
    pub epoch: u64,
    /// Last heartbeat (database clock).
    pub heartbeat_at: DateTime<Utc>,
    /// Until when it is alive without another heartbeat (database clock).
    pub lease_until: DateTime<Utc>,
    /// `lease_until` is still ahead of the database's clock.
    pub alive: bool,
}

/// A host's registration: what its heartbeats must present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLease {
    /// The epoch this registration started.
    pub epoch: u64,
    /// Until when it holds without a heartbeat.
    pub until: DateTime<Utc>,
}

/// A sandbox's owner lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerLease {
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// The owning host.
    pub host_id: String,
    /// The fencing token: larger for every new grant of any sandbox.
    pub token: u64,
    /// When it expires without a renewal (database clock).
    pub expires_at: DateTime<Utc>,
}

/// What a write presents to prove it comes from the current owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The writing host.
    pub host_id: String,
    /// The token of its lease.
    pub token: u64,
}

/// Why a host or lease call failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The host is not registered, or a newer registration of its id
    /// replaced this one.
    #[error("host {host} epoch {epoch} is not the current registration")]
    NotRegistered {
        /// The host.
        host: String,
        /// The epoch presented.
        epoch: u64,
    },
    /// Another host holds the sandbox's lease.
    #[error("sandbox {sandbox} is owned by {owner} until {until}")]
    Owned {
        /// The sandbox.
        sandbox: String,
        /// Its owner.
        owner: String,
        /// Until when.
        until: DateTime<Utc>,
    },
    /// The writer's lease is not the current one (expired, taken over, or
    /// never held): nothing was written.
    #[error("sandbox {sandbox}: host {host} token {token} is not its current owner")]
    Fenced {
        /// The sandbox.
        sandbox: String,
        /// The writer.
        host: String,
        /// The token presented.
        token: u64,
    },
}

/// Result of host calls.
pub type HostResult<T> = Result<T, HostError>;

/// Hosts, their heartbeats and sandbox ownership (see the module docs).
pub trait HostStore: Send + Sync {
    /// Registers (or re-registers) a host: a new epoch, alive for `ttl_ms`.
    fn register_host(&self, info: &HostInfo, ttl_ms: u64) -> HostResult<HostLease>;
    /// Renews host `id`'s registration of `epoch` for `ttl_ms` and records
    /// what it has free; [`HostError::NotRegistered`] when a newer
    /// registration replaced it.
    fn heartbeat(
        &self,
        id: &str,
        epoch: u64,
        free: &HostLoad,
        ttl_ms: u64,
    ) -> HostResult<HostLease>;
    /// Every host, alive or not, by id.
    fn hosts(&self) -> HostResult<Vec<HostRecord>>;
    /// Takes (or renews) sandbox `sandbox`'s lease for `host` for `ttl_ms`.
    /// Free, or held by `host` already: granted (a renewal by the holder
    /// keeps its token while the lease has not expired). Held by another
    /// host: [`HostError::Owned`] until it has been expired for `margin_ms`;
    /// then a new token is granted.
    fn acquire_sandbox(
        &self,
        sandbox: &SandboxId,
        host: &str,
        ttl_ms: u64,
        margin_ms: u64,
    ) -> HostResult<OwnerLease>;
    /// Extends the lease `fence` holds; [`HostError::Fenced`] when it is not
    /// the current one or has expired (the holder must stop acting).
    fn renew_sandbox(
        &self,
        sandbox: &SandboxId,
        fence: &Fence,
        ttl_ms: u64,
    ) -> HostResult<OwnerLease>;
    /// Hands the lease `fence` holds over to host `to` (a move inside the
    /// cluster, docs/move.md): a compare-and-set in one statement, granted
    /// only while the lease is still `fence`'s (same host, same token,
    /// unexpired) and `to` is a live registered host; `to` gets a new,
    /// larger token for `ttl_ms`. Otherwise [`HostError::Fenced`] and
    /// nothing changes.
    fn hand_over_sandbox(
        &self,
        sandbox: &SandboxId,
        fence: &Fence,
        to: &str,
        ttl_ms: u64,
    ) -> HostResult<OwnerLease>;
    /// Gives the lease up (only the holder's own; `false`: it was not).
    fn release_sandbox(&self, sandbox: &SandboxId, fence: &Fence) -> HostResult<bool>;
    /// Every lease host `host` holds or held last (expired or not), by
    /// sandbox id.
    fn host_leases(&self, host: &str) -> HostResult<Vec<OwnerLease>>;
    /// Leases of hosts other than `except` that expired at least
    /// `margin_ms` ago (database clock), oldest first, at most `limit`:
    /// what the host-loss watcher may take over.
    fn expired_leases(
        &self,
        except: &str,
        margin_ms: u64,
        limit: usize,
    ) -> HostResult<Vec<OwnerLease>>;
    /// Leases host `host` holds in the store that are unexpired but expire
    /// within `within_ms` (database clock), soonest first, at most `limit`:
    /// leases nobody renewed for `ttl - within_ms`. A host renews the ones
    /// it runs every round, so these are the ones it does not (a lease
    /// handed over by a move whose adopt call never arrived, docs/move.md).
    fn unrenewed_leases(
        &self,
        host: &str,
        within_ms: u64,
        limit: usize,
    ) -> HostResult<Vec<OwnerLease>>;
    /// The current lease of a sandbox, expired or not.
    fn sandbox_owner(&self, sandbox: &SandboxId) -> HostResult<Option<OwnerLease>>;
    /// [`super::Store::commit`] by the owner of every sandbox written:
    /// in the same transaction, each sandbox's lease must be `fence`'s and
    /// unexpired, else [`HostError::Fenced`] and nothing is written (the
    /// version compare-and-set applies as well).
    fn commit_fenced(
        &self,
        fence: &Fence,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> HostResult<()>;
    /// [`HostStore::commit_fenced`] for a write whose sandboxes this host
    /// holds under leases of their own (a fork: the parent's and the
    /// child's): each sandbox written must be held by `host_id` with the
    /// token `tokens` names for it (a sandbox missing there is refused).
    fn commit_fenced_each(
        &self,
        host_id: &str,
        tokens: &std::collections::BTreeMap<String, u64>,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> HostResult<()>;
    /// Records that host `host` holds template `template`'s subvolume in
    /// its pool. Idempotent.
    fn add_template_holder(&self, template: &str, host: &str) -> HostResult<()>;
    /// Forgets that host `host` holds template `template` (it deleted it).
    /// Idempotent.
    fn remove_template_holder(&self, template: &str, host: &str) -> HostResult<()>;
    /// The hosts that hold template `template`, by id (alive or not).
    fn template_holders(&self, template: &str) -> HostResult<Vec<String>>;
    /// Records that host `host` holds snapshot `snapshot` of sandbox
    /// `sandbox` as a replica (docs/cluster.md "Replicas"): one row per
    /// (sandbox, host), the newest snapshot replaces the one before.
    fn put_replica(&self, sandbox: &SandboxId, host: &str, snapshot: &str) -> HostResult<()>;
    /// Forgets host `host`'s replica of `sandbox`. Idempotent.
    fn remove_replica(&self, sandbox: &SandboxId, host: &str) -> HostResult<()>;
    /// The replicas of `sandbox` (alive hosts or not), by host id.
    fn replicas(&self, sandbox: &SandboxId) -> HostResult<Vec<Replica>>;
    /// The snapshots host `host` holds as replicas of sandboxes not
    /// deleted.
    fn host_replicas(&self, host: &str) -> HostResult<Vec<String>>;
    /// The replicas host `host` holds of sandboxes deleted (or whose record
    /// is gone), at most `limit`, oldest first: (sandbox, snapshot). The
    /// host's periodic pass removes them.
    fn deleted_replicas(&self, host: &str, limit: usize) -> HostResult<Vec<(String, String)>>;
}

/// One replica of a sandbox's snapshot held by a host that does not own
/// the sandbox (PostgreSQL's `sandbox_replicas`, cluster migration 4).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Replica {
    /// The host holding it.
    pub host_id: String,
    /// The snapshot it holds (the newest one replicated to it).
    pub snapshot_id: String,
    /// Since when (ms since the epoch, database clock).
    pub held_since: i64,
}
