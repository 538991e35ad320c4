//! The service layer: typed commands, per-sandbox operation locks, the
//! "record pending, act, finalize" rule, wake-on-access.
//!
//! Every state-changing operation:
//! 1. takes the sandbox's operation lock: a second user operation while one
//!    runs gets `409 conflict` at once (no queue); a user operation arriving
//!    during a background one (rolling snapshot) waits for it, it is short;
//! 2. asks `state.apply(op)` whether the operation is allowed;
//! 3. records the operation as pending (sandbox `pending_op`, snapshot rows
//!    `pending`, a journal entry) before calling the engine;
//! 4. finalizes: the new state on success; on failure the previous state
//!    stays, with the reason in `state_reason` and the journal.
//!
//! A crash between 3 and 4 leaves a pending record that recovery rolls back
//! or completes; a pending snapshot is never listed as ready.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use strata_core::{
    ErrorCode, Op, SandboxId, SandboxSize, SandboxState, SizeError, SnapshotId, TemplateId,
    TransitionError,
};
use tokio::sync::OwnedMutexGuard;
use tracing::{info, warn, Instrument};

use crate::caller::{Caller, PLATFORM_SCOPE};
use crate::clock::Clock;
use crate::config::Config;
use crate::engine::{
    ByteStream, Engine, EngineError, ExecEvent, ExecRequest, ExecStream, FileStat, Source,
};
use crate::metrics::{step, Metrics};
use crate::retention::Point;
use crate::scheduler::{Actions, SchedulerHandle, Timing};
use crate::security::gate::{GateOptions, GateRefusal, ToolGate};
use crate::store::*;
use strata_policy::{CallKind, ToolCall};

/// Why a service call failed; maps onto the API's error codes.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Malformed request.
    #[error("{0}")]
    InvalidRequest(String),
    /// Size outside the absolute bounds.
    #[error(transparent)]
    InvalidSize(#[from] SizeError),
    /// Not enough room on this host.
    #[error("{0}")]
    InsufficientCapacity(String),
    /// No such resource.
    #[error("{kind} {id} not found")]
    NotFound {
        /// Resource kind.
        kind: &'static str,
        /// Id as given.
        id: String,
    },
    /// Not allowed in the present state.
    #[error(transparent)]
    InvalidState(#[from] TransitionError),
    /// Not allowed for another reason tied to state (template building...).
    #[error("{0}")]
    InvalidStateOther(String),
    /// Another operation is in progress.
    #[error("{0}")]
    Conflict(String),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The store failed.
    #[error("metadata store")]
    Store(#[from] StoreError),
    /// The caller's role or scope does not allow this (a platform template).
    #[error("{0}")]
    Forbidden(String),
    /// The tool-call gate refused (denied, held for approval, or failed closed).
    #[error("{}", gate_message(.0))]
    Gate(GateRefusal),
}

fn gate_message(r: &GateRefusal) -> String {
    match r {
        GateRefusal::Invalid(m) | GateRefusal::Internal(m) => m.clone(),
        GateRefusal::Denied { message, .. } => message.clone(),
        GateRefusal::Pending(req) => format!("held for approval {}", req.id),
    }
}

impl ServiceError {
    /// The stable API code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ServiceError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            ServiceError::InvalidSize(_) => ErrorCode::InvalidSize,
            ServiceError::InsufficientCapacity(_) => ErrorCode::InsufficientCapacity,
            ServiceError::NotFound { .. } => ErrorCode::NotFound,
            ServiceError::InvalidState(_) | ServiceError::InvalidStateOther(_) => {
                ErrorCode::InvalidState
            }
            ServiceError::Conflict(_) => ErrorCode::Conflict,
            ServiceError::Engine(e) => e.code(),
            ServiceError::Store(StoreError::BadCursor) => ErrorCode::InvalidRequest,
            ServiceError::Store(_) => ErrorCode::Internal,
            ServiceError::Forbidden(_) => ErrorCode::Forbidden,
            ServiceError::Gate(GateRefusal::Invalid(_)) => ErrorCode::InvalidRequest,
            ServiceError::Gate(GateRefusal::Internal(_)) => ErrorCode::Internal,
            ServiceError::Gate(GateRefusal::Denied { .. } | GateRefusal::Pending(_)) => {
                ErrorCode::PolicyDenied
            }
        }
    }

    /// The message for the API: the whole chain, once.
    pub fn message(&self) -> String {
        let mut msg = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(e) = src {
            msg.push_str(": ");
            msg.push_str(&e.to_string());
            src = e.source();
        }
        msg
    }
}

/// Result of service calls.
pub type ServiceResult<T> = Result<T, ServiceError>;

fn not_found(kind: &'static str, id: impl ToString) -> ServiceError {
    ServiceError::NotFound {
        kind,
        id: id.to_string(),
    }
}

/// A size in a request: missing fields come from the template (or the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeSpec {
    /// Virtual CPUs.
    pub vcpus: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: Option<u32>,
    /// Disk in GiB.
    pub disk_gib: Option<u32>,
}

impl SizeSpec {
    /// Fills missing fields from `base`.
    pub fn over(&self, base: SandboxSize) -> SandboxSize {
        SandboxSize {
            vcpus: self.vcpus.unwrap_or(base.vcpus),
            memory_mib: self.memory_mib.unwrap_or(base.memory_mib),
            disk_gib: self.disk_gib.unwrap_or(base.disk_gib),
        }
    }
}

/// Settings of a new sandbox (create and fork).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Size (fields default to the template's or the source's).
    #[serde(default)]
    pub size: SizeSpec,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Idle timeout, e.g. `"30m"`; `"0s"` never hibernates.
    #[serde(default)]
    pub idle_timeout: Option<String>,
    /// Rolling snapshot interval, e.g. `"60s"`; `"0s"` turns them off.
    #[serde(default)]
    pub snapshot_interval: Option<String>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Template to start from (default: the newest ready template).
    #[serde(default)]
    pub template: Option<TemplateId>,
    /// Settings.
    #[serde(flatten)]
    pub spec: SandboxSpec,
}

/// Where a rewind goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rewind {
    /// A snapshot of this sandbox.
    #[serde(default)]
    pub to: Option<SnapshotId>,
    /// Or a time ago, e.g. `"10m"`: the newest snapshot at or before then.
    #[serde(default)]
    pub ago: Option<String>,
}

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeSnapshot {
    /// Free-form label.
    #[serde(default)]
    pub label: Option<String>,
}

/// `POST /v1/templates`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplate {
    /// Id to use (default: generated).
    #[serde(default)]
    pub id: Option<TemplateId>,
    /// Human name.
    #[serde(default)]
    pub name: Option<String>,
    /// Size of the template guest.
    #[serde(default)]
    pub size: SizeSpec,
}

/// Progress of a template build (kept in memory).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BuildProgress {
    /// Current step.
    pub step: String,
    /// Fraction done, when known.
    pub fraction: Option<f32>,
}

/// A template with its build progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateView {
    /// The record.
    #[serde(flatten)]
    pub record: TemplateRecord,
    /// Progress while building.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<BuildProgress>,
}

/// A tool call the gate allowed on one sandbox of its caller (made only by
/// [`Service::grant`] and [`Service::access`]). Guest file operations run
/// under a grant and only on the paths it covers, so what the gate decided
/// and what runs come from the same values.
#[derive(Debug, Clone)]
pub struct Grant {
    sandbox: SandboxId,
    caller: Caller,
    kind: Option<CallKind>,
}

/// A guest file operation, for [`Grant::covers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestOp {
    /// Read a file's content.
    Read,
    /// Stat a path.
    Stat,
    /// List a directory.
    List,
    /// Write a file.
    Write,
    /// Make a directory.
    Mkdir,
    /// Remove a path.
    Remove,
}

fn is_under(path: &str, dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    path.strip_prefix(dir)
        .is_some_and(|rest| rest.starts_with('/'))
}

impl Grant {
    /// The sandbox.
    pub fn sandbox(&self) -> &SandboxId {
        &self.sandbox
    }

    /// Who it was granted to.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// The call the gate decided (`None` for [`Service::access`]).
    pub fn kind(&self) -> Option<&CallKind> {
        self.kind.as_ref()
    }

    /// Whether `op` on `path` is what the gate decided: a read covers
    /// reading, stating and listing the path and what is below it; a write
    /// covers writing, removing and making the path, and stating or making
    /// the directories above it (an upload makes its parent).
    pub fn covers(&self, op: GuestOp, path: &str) -> bool {
        match &self.kind {
            Some(CallKind::FileRead { path: p }) => {
                matches!(op, GuestOp::Read | GuestOp::Stat | GuestOp::List)
                    && (path == p || is_under(path, p))
            }
            Some(CallKind::FileWrite { path: p }) => match op {
                GuestOp::Write | GuestOp::Remove => path == p,
                GuestOp::Mkdir | GuestOp::Stat => path == p || is_under(p, path),
                GuestOp::Read | GuestOp::List => false,
            },
            _ => false,
        }
    }
}

fn lifecycle(op: &str) -> CallKind {
    CallKind::Lifecycle { op: op.to_owned() }
}

/// Who holds an operation lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    User,
    Background,
}

#[derive(Debug, Default)]
struct OpSlot {
    lock: Arc<tokio::sync::Mutex<()>>,
    holder: Mutex<Option<(Op, Who)>>,
}

/// Held for the duration of an operation on one sandbox.
struct OpGuard {
    _guard: OwnedMutexGuard<()>,
    slot: Arc<OpSlot>,
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        *self.slot.holder.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// How long a user operation waits for a background one to finish.
const BACKGROUND_WAIT: Duration = Duration::from_secs(30);
/// Activity is written to the store at most this often per sandbox.
const ACTIVITY_FLUSH: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

/// The daemon's operations, shared by the HTTP API, the scheduler and recovery.
pub struct Service {
    store: Arc<dyn Store>,
    engine: Arc<dyn Engine>,
    sched: SchedulerHandle,
    metrics: Arc<Metrics>,
    config: Arc<Config>,
    clock: Arc<dyn Clock>,
    slots: Mutex<HashMap<SandboxId, Arc<OpSlot>>>,
    placement: tokio::sync::Mutex<()>,
    progress: Mutex<HashMap<TemplateId, BuildProgress>>,
    flushed: Mutex<HashMap<SandboxId, DateTime<Utc>>>,
    gate: Arc<dyn ToolGate>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

fn parse_opt_duration(s: &Option<String>, what: &str) -> ServiceResult<Option<u64>> {
    match s {
        None => Ok(None),
        Some(s) => crate::duration::parse_duration(s)
            .map(|d| Some(d.as_secs()))
            .map_err(|e| ServiceError::InvalidRequest(format!("{what}: {e}"))),
    }
}

/// Checks a guest path from a request: absolute, no `..`, no NUL, bounded.
pub fn validate_guest_path(path: &str) -> ServiceResult<()> {
    let bad = |why: &str| {
        Err(ServiceError::InvalidRequest(format!(
            "path {path:?}: {why}"
        )))
    };
    if path.is_empty() {
        return bad("empty");
    }
    if path.len() > 4096 {
        return bad("longer than 4096 bytes");
    }
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    if !path.starts_with('/') {
        return bad("must be absolute");
    }
    if path.split('/').any(|c| c == "..") {
        return bad("contains a `..` component");
    }
    Ok(())
}

/// Checks a command from a request: a program, no NUL bytes, a valid cwd.
fn validate_exec(req: &ExecRequest) -> ServiceResult<()> {
    if req.cmd.is_empty() || req.cmd[0].is_empty() {
        return Err(ServiceError::InvalidRequest(
            "cmd: give at least the program".into(),
        ));
    }
    if req
        .cmd
        .iter()
        .chain(req.env.keys())
        .chain(req.env.values())
        .any(|s| s.contains('\0'))
    {
        return Err(ServiceError::InvalidRequest(
            "cmd/env: NUL bytes are not allowed".into(),
        ));
    }
    if let Some(cwd) = &req.cwd {
        validate_guest_path(cwd)?;
    }
    Ok(())
}

/// Longest idle timeout a sandbox may have (a year): larger values would
/// overflow the time arithmetic of the E2B door's `endAt` and gain nothing.
pub const MAX_IDLE_TIMEOUT_S: u64 = 366 * 24 * 3600;

/// Id of the template built on first start.
pub const DEFAULT_TEMPLATE: &str = "tpl-default";

/// A sandbox made from a snapshot keeps its vCPUs and memory; its disk only grows.
fn check_source_size(what: &str, source: SandboxSize, asked: SandboxSize) -> ServiceResult<()> {
    if asked.vcpus != source.vcpus || asked.memory_mib != source.memory_mib {
        return Err(ServiceError::InvalidRequest(format!(
            "{what} has {} vCPU(s) and {} MiB; a sandbox made from it keeps them (asked {} vCPU(s), {} MiB): leave vcpus/memory_mib out or build a template of that size",
            source.vcpus, source.memory_mib, asked.vcpus, asked.memory_mib
        )));
    }
    if asked.disk_gib < source.disk_gib {
        return Err(ServiceError::InvalidRequest(format!(
            "disk_gib {} is smaller than {what}'s {} GiB; disks only grow",
            asked.disk_gib, source.disk_gib
        )));
    }
    Ok(())
}

fn validate_labels(labels: &BTreeMap<String, String>) -> ServiceResult<()> {
    if labels.len() > 64 {
        return Err(ServiceError::InvalidRequest("at most 64 labels".into()));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
        if !key_ok || v.len() > 255 || v.contains('\0') {
            return Err(ServiceError::InvalidRequest(format!(
                "label {k:?}: keys are 1-63 of [A-Za-z0-9-_./], values at most 255 bytes"
            )));
        }
    }
    Ok(())
}

impl Service {
    /// A service over these parts.
    pub fn new(
        store: Arc<dyn Store>,
        engine: Arc<dyn Engine>,
        config: Arc<Config>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        gate: Arc<dyn ToolGate>,
    ) -> Arc<Self> {
        Arc::new(Service {
            gate,
            store,
            engine,
            sched: SchedulerHandle::new(),
            metrics,
            config,
            clock,
            slots: Mutex::new(HashMap::new()),
            placement: tokio::sync::Mutex::new(()),
            progress: Mutex::new(HashMap::new()),
            flushed: Mutex::new(HashMap::new()),
        })
    }

    /// The scheduler's handle.
    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.sched
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    /// The injected clock.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    /// The clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// Runs a store call on the blocking pool.
    pub async fn db<T, F>(&self, f: F) -> ServiceResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store) -> StoreResult<T> + Send + 'static,
    {
        let s = self.store.clone();
        tokio::task::spawn_blocking(move || f(s.as_ref()))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
            .map_err(Into::into)
    }

    fn timing(&self, rec: &SandboxRecord) -> Timing {
        Timing {
            snapshot_interval: rec
                .snapshot_interval_s
                .map(Duration::from_secs)
                .unwrap_or(self.config.snapshot_interval),
            idle_timeout: rec
                .idle_timeout_s
                .map(Duration::from_secs)
                .unwrap_or(self.config.idle_timeout),
        }
    }

    /// Tells the scheduler about a sandbox's (new) state.
    pub fn reschedule(&self, rec: &SandboxRecord) {
        self.sched.set(
            &rec.id,
            rec.state,
            self.timing(rec),
            rec.last_activity_at,
            self.now(),
        );
    }

    async fn acquire(&self, id: &SandboxId, op: Op, who: Who) -> ServiceResult<OpGuard> {
        let slot = {
            let mut g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            g.entry(id.clone()).or_default().clone()
        };
        let guard = match slot.lock.clone().try_lock_owned() {
            Ok(g) => g,
            Err(_) => {
                let holder = *slot.holder.lock().unwrap_or_else(|p| p.into_inner());
                match (who, holder) {
                    (Who::User, Some((_, Who::Background)) | None) => {
                        tokio::time::timeout(BACKGROUND_WAIT, slot.lock.clone().lock_owned())
                            .await
                            .map_err(|_| {
                                ServiceError::Conflict(format!(
                                    "sandbox {id} is busy with a background operation"
                                ))
                            })?
                    }
                    (_, Some((held, _))) => {
                        return Err(ServiceError::Conflict(format!(
                            "another operation ({held}) is in progress on {id}"
                        )))
                    }
                    (Who::Background, None) => {
                        return Err(ServiceError::Conflict(format!("{id} is busy")))
                    }
                }
            }
        };
        *slot.holder.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, who));
        Ok(OpGuard {
            _guard: guard,
            slot,
        })
    }

    /// A sandbox record that is not deleted, whoever owns it (the
    /// service's own bookkeeping; commands look up through
    /// [`Service::get_sandbox`]).
    async fn record(&self, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_sandbox(&id2)).await? {
            Some(r) if r.state != SandboxState::Deleted => Ok(r),
            _ => Err(not_found("sandbox", id)),
        }
    }

    /// A sandbox record the caller may see: another tenant's sandbox
    /// answers exactly like an unknown id.
    pub async fn get_sandbox(
        &self,
        caller: &Caller,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
        match self.record(id).await {
            Ok(r) if caller.sees(&r.tenant) => Ok(r),
            Ok(_) => Err(not_found("sandbox", id)),
            Err(e) => Err(e),
        }
    }

    /// A filtered page of the caller's sandboxes (the filter's tenant is
    /// the caller's; only the daemon lists another tenant's).
    pub async fn list_sandboxes(
        &self,
        caller: &Caller,
        mut f: SandboxFilter,
    ) -> ServiceResult<Page<SandboxRecord>> {
        if let Some(t) = caller.tenant() {
            f.tenant = t.to_owned();
        }
        self.db(move |s| s.list_sandboxes(&f)).await
    }

    /// A snapshot record that is not deleted, whoever owns it.
    async fn snapshot_record(&self, id: &SnapshotId) -> ServiceResult<SnapshotRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_snapshot(&id2)).await? {
            Some(r) if r.status != SnapshotStatus::Deleted => Ok(r),
            _ => Err(not_found("snapshot", id)),
        }
    }

    /// A template record that is not deleted, whoever owns it.
    async fn template_record(&self, id: &TemplateId) -> ServiceResult<TemplateRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_template(&id2)).await? {
            Some(r) if r.status != TemplateStatus::Deleted => Ok(r),
            _ => Err(not_found("template", id)),
        }
    }

    /// Decides a tool call of `caller` through the gate (policy, approval,
    /// audit), with the values the action will use. The daemon's own work
    /// ([`Caller::System`]) is not a tool call: it is not gated.
    pub async fn authorize(
        &self,
        caller: &Caller,
        sandbox: Option<&SandboxId>,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<()> {
        let Some(tenant) = caller.tenant() else {
            return Ok(());
        };
        let call = ToolCall {
            tenant: tenant.to_owned(),
            sandbox: sandbox.map(|s| s.to_string()),
            actor: caller.actor(),
            kind,
        };
        self.gate
            .check(call, opts.clone())
            .await
            .map_err(ServiceError::Gate)
    }

    /// Looks up the caller's sandbox `id`, then gates `kind` on it.
    async fn authorize_on(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let rec = self.get_sandbox(caller, id).await?;
        self.authorize(caller, Some(id), kind, opts).await?;
        Ok(rec)
    }

    /// Records activity: postpones idle hibernation; persisted lazily.
    pub fn touch(&self, id: &SandboxId) {
        let now = self.now();
        self.sched.touch(id, now);
        let due = {
            let mut g = self.flushed.lock().unwrap_or_else(|p| p.into_inner());
            let last = g.get(id).copied();
            if last.is_none_or(|l| now - l >= ACTIVITY_FLUSH) {
                g.insert(id.clone(), now);
                true
            } else {
                false
            }
        };
        if due {
            let store = self.store.clone();
            let id = id.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = store.touch_sandbox(&id, now) {
                    warn!(sandbox = %id, error = %e, "recording activity failed");
                }
            });
        }
    }

    /// Writes `rec` with a journal entry.
    async fn save(
        &self,
        rec: &SandboxRecord,
        op: Op,
        from: SandboxState,
        phase: EventPhase,
        detail: Option<String>,
    ) -> ServiceResult<()> {
        let mut ev = Event::new(rec, op, Some(rec.state), phase, detail, self.now());
        ev.from_state = Some(from);
        let rec = rec.clone();
        self.db(move |s| s.update_sandbox(&rec, Some(&ev))).await
    }

    /// Marks `rec` as doing `op` (pending) before the engine acts.
    async fn begin(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        detail: Option<String>,
    ) -> ServiceResult<()> {
        rec.pending_op = Some(op);
        rec.updated_at = self.now();
        let from = rec.state;
        self.save(rec, op, from, EventPhase::Pending, detail).await
    }

    /// Finalizes a successful `op`: the new state is acknowledged.
    async fn done(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        next: SandboxState,
        snaps: &[&SnapshotRecord],
        detail: Option<String>,
    ) -> ServiceResult<()> {
        let from = rec.state;
        rec.state = next;
        rec.pending_op = None;
        rec.state_reason = None;
        rec.updated_at = self.now();
        if !next.has_vm() {
            rec.pid = None;
        }
        let mut ev = Event::new(rec, op, Some(next), EventPhase::Done, detail, self.now());
        ev.from_state = Some(from);
        let (r, s): (SandboxRecord, Vec<SnapshotRecord>) =
            (rec.clone(), snaps.iter().map(|s| (*s).clone()).collect());
        self.db(move |st| {
            let refs: Vec<&SnapshotRecord> = s.iter().collect();
            st.commit(&[&r], &refs, Some(&ev))
        })
        .await?;
        self.reschedule(rec);
        Ok(())
    }

    /// Finalizes a failed `op`: the previous state stays, the reason is kept.
    async fn failed(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        err: &EngineError,
        snaps: &[&SnapshotRecord],
    ) {
        rec.pending_op = None;
        rec.state_reason = Some(format!("{op} failed: {err}"));
        rec.updated_at = self.now();
        let mut ev = Event::new(
            rec,
            op,
            Some(rec.state),
            EventPhase::Failed,
            Some(err.to_string()),
            self.now(),
        );
        ev.from_state = Some(rec.state);
        let (r, s): (SandboxRecord, Vec<SnapshotRecord>) =
            (rec.clone(), snaps.iter().map(|s| (*s).clone()).collect());
        if let Err(e) = self
            .db(move |st| {
                let refs: Vec<&SnapshotRecord> = s.iter().collect();
                st.commit(&[&r], &refs, Some(&ev))
            })
            .await
        {
            warn!(sandbox = %rec.id, error = %e.message(), "recording a failed {op} failed");
        }
        self.metrics.count("operation_failed");
    }

    fn new_snapshot(
        &self,
        rec: &SandboxRecord,
        kind: SnapshotKind,
        label: Option<String>,
    ) -> SnapshotRecord {
        SnapshotRecord {
            id: SnapshotId::generate(),
            tenant: rec.tenant.clone(),
            sandbox_id: rec.id.clone(),
            kind,
            label,
            status: SnapshotStatus::Pending,
            status_reason: None,
            created_at: self.now(),
            pause_ms: None,
            exclusive_bytes: None,
            referenced_bytes: None,
        }
    }

    fn ready(snap: &mut SnapshotRecord, info: &crate::engine::SnapshotInfo) {
        snap.status = SnapshotStatus::Ready;
        snap.created_at = info.created_at;
        snap.pause_ms = Some(info.pause_ms);
    }

    fn dropped(snap: &mut SnapshotRecord, why: String) {
        snap.status = SnapshotStatus::Deleted;
        snap.status_reason = Some(why);
    }

    /// Records a new sandbox and the snapshot made for it, both pending, in
    /// one transaction before the engine acts: a crash before the end is
    /// rolled back by recovery (sandbox deleted, snapshot removed).
    async fn begin_create(
        &self,
        rec: &SandboxRecord,
        snap: &SnapshotRecord,
        detail: String,
    ) -> ServiceResult<()> {
        let ev = Event::new(
            rec,
            Op::Created,
            None,
            EventPhase::Pending,
            Some(detail),
            self.now(),
        );
        let (r, sn) = (rec.clone(), snap.clone());
        self.db(move |s| {
            s.insert_sandbox(&r, &ev)?;
            s.put_snapshot(&sn)
        })
        .await
    }

    /// Records a sandbox whose creation failed as deleted, with the snapshot
    /// made for it, in one transaction (best effort: the engine already
    /// failed, and recovery rolls back a pending create anyway).
    async fn abandon_create(
        &self,
        mut rec: SandboxRecord,
        mut snap: SnapshotRecord,
        why: String,
        err: &EngineError,
    ) {
        Self::dropped(&mut snap, why.clone());
        rec.pending_op = None;
        rec.state = SandboxState::Deleted;
        rec.deleted_at = Some(self.now());
        rec.state_reason = Some(why);
        let ev = Event::new(
            &rec,
            Op::Created,
            Some(SandboxState::Deleted),
            EventPhase::Failed,
            Some(err.to_string()),
            self.now(),
        );
        let _ = self
            .db(move |s| s.commit(&[&rec], &[&snap], Some(&ev)))
            .await;
    }

    fn observe_snapshot(&self, started: Instant, info: &crate::engine::SnapshotInfo) {
        self.metrics.observe_step(step::SNAPSHOT, started.elapsed());
        self.metrics.observe_step(
            step::SNAPSHOT_PAUSE,
            Duration::from_secs_f64(info.pause_ms.max(0.0) / 1000.0),
        );
    }

    fn spawn_usage(self: &Arc<Self>, snap: SnapshotId) {
        let this = self.clone();
        tokio::spawn(async move {
            if let Ok(u) = this.engine.snapshot_usage(&snap).await {
                let id = snap.clone();
                let _ = this
                    .db(move |s| {
                        if let Some(mut r) = s.get_snapshot(&id)? {
                            r.exclusive_bytes = Some(u.exclusive_bytes);
                            r.referenced_bytes = Some(u.referenced_bytes);
                            s.put_snapshot(&r)?;
                        }
                        Ok(())
                    })
                    .await;
            }
        });
    }

    async fn check_capacity(&self, size: SandboxSize) -> ServiceResult<()> {
        let (cap_cpu, cap_mem) = self.config.capacity.resolve();
        let (used_cpu, used_mem) = self.db(|s| s.reserved_capacity()).await?;
        if used_cpu + u64::from(size.vcpus) > cap_cpu
            || used_mem + u64::from(size.memory_mib) > cap_mem
        {
            return Err(ServiceError::InsufficientCapacity(format!(
                "this host has {} of {cap_cpu} vCPUs and {} of {cap_mem} MiB free; asked for {} vCPUs and {} MiB",
                cap_cpu.saturating_sub(used_cpu),
                cap_mem.saturating_sub(used_mem),
                size.vcpus,
                size.memory_mib
            )));
        }
        Ok(())
    }

    fn new_record(
        &self,
        owner: &str,
        spec: &SandboxSpec,
        size: SandboxSize,
    ) -> ServiceResult<SandboxRecord> {
        validate_labels(&spec.labels)?;
        let now = self.now();
        Ok(SandboxRecord {
            id: SandboxId::generate(),
            tenant: owner.to_owned(),
            template: None,
            source_snapshot: None,
            size,
            labels: spec.labels.clone(),
            state: SandboxState::Creating,
            state_reason: None,
            pending_op: Some(Op::Created),
            idle_timeout_s: match parse_opt_duration(&spec.idle_timeout, "idle_timeout")? {
                Some(t) if t > MAX_IDLE_TIMEOUT_S => {
                    return Err(ServiceError::InvalidRequest(format!(
                        "idle_timeout: at most {MAX_IDLE_TIMEOUT_S}s (a year)"
                    )))
                }
                t => t,
            },
            snapshot_interval_s: parse_opt_duration(&spec.snapshot_interval, "snapshot_interval")?,
            created_at: now,
            updated_at: now,
            last_activity_at: now,
            pid: None,
            accel: None,
            deleted_at: None,
        })
    }

    /// The template a create starts from: the one named, or the newest ready
    /// one. A template still being built (the default one on a first start)
    /// is waited for, up to `template_wait`.
    async fn resolve_template(
        &self,
        caller: &Caller,
        id: Option<&TemplateId>,
    ) -> ServiceResult<TemplateRecord> {
        let deadline = Instant::now() + self.config.template_wait;
        loop {
            let tpl = match id {
                Some(id) => self.get_template(caller, id).await?.record,
                None => {
                    let all = self.db(|s| s.list_templates(PLATFORM_SCOPE)).await?;
                    let ready = all.iter().rev().find(|t| t.status == TemplateStatus::Ready);
                    let building = all
                        .iter()
                        .rev()
                        .find(|t| t.status == TemplateStatus::Building);
                    match (ready, building) {
                        (Some(t), _) | (None, Some(t)) => t.clone(),
                        (None, None) => {
                            let failed = all
                                .iter()
                                .rev()
                                .find(|t| t.status == TemplateStatus::Failed)
                                .map(|t| {
                                    format!(
                                        " (template {} failed: {})",
                                        t.id,
                                        t.status_reason.as_deref().unwrap_or("unknown reason")
                                    )
                                })
                                .unwrap_or_default();
                            return Err(ServiceError::InvalidStateOther(format!(
                                "no template given and none is ready{failed}: build one with POST /v1/templates"
                            )));
                        }
                    }
                }
            };
            match tpl.status {
                TemplateStatus::Ready => return Ok(tpl),
                TemplateStatus::Building if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                TemplateStatus::Building => {
                    let step = self
                        .template_view(tpl.clone())
                        .progress
                        .map(|p| format!(" (now: {})", p.step))
                        .unwrap_or_default();
                    return Err(ServiceError::InvalidStateOther(format!(
                        "template {} is still being built{step}; retry later",
                        tpl.id
                    )));
                }
                other => {
                    return Err(ServiceError::InvalidStateOther(format!(
                        "template {} is {}{}",
                        tpl.id,
                        other.as_str(),
                        tpl.status_reason
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    )))
                }
            }
        }
    }

    /// Creates a sandbox from a template. vCPUs and memory are the template's
    /// (a snapshot restores with the RAM and CPUs it was taken with); the
    /// disk may be larger than the template's (it grows).
    pub async fn create(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let tpl = self.admit_create(caller, &cmd, opts).await?;
        let size = cmd.spec.size.over(tpl.size);
        size.validate()?;
        check_source_size(&format!("template {}", tpl.id), tpl.size, size)?;
        let mut rec = self.new_record(caller.owner(), &cmd.spec, size)?;
        rec.template = Some(tpl.id.clone());
        self.spawn_new(rec, Source::Template(tpl.id), step::SPAWN)
            .await
    }

    /// The checks every create makes, in order: the size, the template is
    /// one the caller may use (else `not_found`, as for an unknown id), the
    /// gate (`lifecycle create`), then the template is ready (waiting for a
    /// build in progress).
    async fn admit_create(
        &self,
        caller: &Caller,
        cmd: &CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateRecord> {
        let size = cmd.spec.size.over(SandboxSize::default());
        size.validate()?;
        if let Some(t) = &cmd.template {
            self.get_template(caller, t).await?;
        }
        self.authorize(caller, None, lifecycle("create"), opts)
            .await?;
        self.resolve_template(caller, cmd.template.as_ref()).await
    }

    /// Creates a sandbox from a template directly in the hibernated state
    /// (`"start": false`): no VM starts and no capacity is reserved. Its wake
    /// snapshot is a copy-on-write snapshot of the template (listed as its
    /// `hibernate` snapshot, kept by retention as its newest), and its first
    /// use (exec, files, resume, snapshot, fork) wakes it with a new identity
    /// and the size asked here. Validated like [`Service::create`].
    pub async fn create_hibernated(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let tpl = self.admit_create(caller, &cmd, opts).await?;
        let size = cmd.spec.size.over(tpl.size);
        size.validate()?;
        check_source_size(&format!("template {}", tpl.id), tpl.size, size)?;
        let mut rec = self.new_record(caller.owner(), &cmd.spec, size)?;
        rec.template = Some(tpl.id.clone());
        let span = tracing::info_span!("create_hibernated", sandbox = %rec.id);
        async move {
            let mut snap = self.new_snapshot(&rec, SnapshotKind::Hibernate, None);
            {
                // Recorded first, both pending: a crash before the end is
                // rolled back by recovery (sandbox deleted, snapshot removed).
                self.begin_create(
                    &rec,
                    &snap,
                    format!("start=false, wake snapshot {}", snap.id),
                )
                .await?;
            }
            let source = Source::Template(tpl.id.clone());
            match self
                .engine
                .create_hibernated(&rec.id, &source, &snap.id, rec.size)
                .await
            {
                Ok(info) => {
                    Self::ready(&mut snap, &info);
                    self.done(
                        &mut rec,
                        Op::Created,
                        SandboxState::Hibernated,
                        &[&snap],
                        Some(format!("hibernated, wakes from {}", snap.id)),
                    )
                    .await?;
                    self.spawn_usage(snap.id.clone());
                    info!(snapshot = %snap.id, "sandbox created hibernated");
                    Ok(rec)
                }
                Err(e) => {
                    warn!(error = %e, "create (hibernated) failed");
                    let _ = self.engine.delete_snapshot(&snap.id).await;
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, snap, format!("create failed: {e}"), &e)
                        .await;
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Starts the build of the default template (`tpl-default`, named
    /// `default`, of `default_size`) unless a template is ready or building.
    /// Returns the build started, if any.
    pub async fn ensure_default_template(self: &Arc<Self>) -> ServiceResult<Option<TemplateView>> {
        let all = self.db(|s| s.list_templates(PLATFORM_SCOPE)).await?;
        if all
            .iter()
            .any(|t| matches!(t.status, TemplateStatus::Ready | TemplateStatus::Building))
        {
            return Ok(None);
        }
        let id: TemplateId = DEFAULT_TEMPLATE
            .parse()
            .map_err(|e: strata_core::id::IdError| ServiceError::InvalidRequest(e.to_string()))?;
        info!(template = %id, "no template yet: building the default one in the background");
        let v = self
            .build_template(
                &Caller::system(crate::caller::SystemReason::Platform),
                BuildTemplate {
                    id: Some(id),
                    name: Some("default".into()),
                    size: SizeSpec::default(),
                },
                &GateOptions::default(),
            )
            .await?;
        Ok(Some(v))
    }

    /// Records a new sandbox as creating, starts its VM, finalizes.
    async fn spawn_new(
        &self,
        mut rec: SandboxRecord,
        source: Source,
        step_name: &str,
    ) -> ServiceResult<SandboxRecord> {
        let span = tracing::info_span!("create", sandbox = %rec.id);
        async move {
            {
                let _placement = self.placement.lock().await;
                self.check_capacity(rec.size).await?;
                let ev = Event::new(
                    &rec,
                    Op::Created,
                    None,
                    EventPhase::Pending,
                    None,
                    self.now(),
                );
                let r = rec.clone();
                self.db(move |s| s.insert_sandbox(&r, &ev)).await?;
            }
            let started = Instant::now();
            match self.engine.create(&rec.id, &source, rec.size).await {
                Ok(vm) => {
                    self.metrics.observe_step(step_name, started.elapsed());
                    rec.pid = Some(vm.pid);
                    rec.accel = Some(vm.accel);
                    self.done(&mut rec, Op::Created, SandboxState::Running, &[], None)
                        .await?;
                    info!(pid = vm.pid, ready_ms = vm.ready_ms, "sandbox running");
                    Ok(rec)
                }
                Err(e) => {
                    warn!(error = %e, "create failed");
                    let _ = self.engine.delete(&rec.id).await;
                    rec.pending_op = None;
                    rec.state = SandboxState::Deleted;
                    rec.deleted_at = Some(self.now());
                    rec.state_reason = Some(format!("create failed: {e}"));
                    let ev = Event::new(
                        &rec,
                        Op::Created,
                        Some(SandboxState::Deleted),
                        EventPhase::Failed,
                        Some(e.to_string()),
                        self.now(),
                    );
                    let r = rec.clone();
                    let _ = self.db(move |s| s.update_sandbox(&r, Some(&ev))).await;
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Makes sure a sandbox runs, waking it from hibernation (wake-on-access).
    async fn ensure_awake(self: &Arc<Self>, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let rec = self.record(id).await?;
        self.touch(id);
        if rec.state == SandboxState::Hibernated {
            return self.resume_ungated(id).await;
        }
        Ok(rec)
    }

    /// Deletes a sandbox and its snapshots.
    pub async fn delete(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        self.authorize_on(caller, id, lifecycle("delete"), opts)
            .await?;
        let _g = self.acquire(id, Op::Delete, Who::User).await?;
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Delete)?;
        self.begin(&mut rec, Op::Delete, None).await?;
        if let Err(e) = self.engine.delete(id).await {
            self.failed(&mut rec, Op::Delete, &e, &[]).await;
            return Err(e.into());
        }
        rec.deleted_at = Some(self.now());
        let id2 = id.clone();
        let mut snaps = self.db(move |s| s.list_snapshots(&id2, false)).await?;
        for s in &mut snaps {
            Self::dropped(s, "sandbox deleted".into());
        }
        let refs: Vec<&SnapshotRecord> = snaps.iter().collect();
        self.done(&mut rec, Op::Delete, next, &refs, None).await?;
        self.sched.remove(id);
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        for s in snaps {
            if let Err(e) = self.engine.delete_snapshot(&s.id).await {
                warn!(sandbox = %id, snapshot = %s.id, error = %e, "removing snapshot failed; recovery will retry");
            }
        }
        Ok(rec)
    }

    /// Pauses a running sandbox.
    pub async fn pause(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        self.authorize_on(caller, id, lifecycle("pause"), opts)
            .await?;
        let _g = self.acquire(id, Op::Pause, Who::User).await?;
        let mut rec = self.record(id).await?;
        self.touch(id);
        let next = rec.state.apply(Op::Pause)?;
        self.begin(&mut rec, Op::Pause, None).await?;
        match self.engine.pause(id).await {
            Ok(()) => {
                self.done(&mut rec, Op::Pause, next, &[], None).await?;
                Ok(rec)
            }
            Err(e) => {
                self.failed(&mut rec, Op::Pause, &e, &[]).await;
                Err(e.into())
            }
        }
    }

    /// Resumes a paused sandbox or wakes a hibernated one.
    pub async fn resume(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        self.authorize_on(caller, id, lifecycle("resume"), opts)
            .await?;
        self.resume_ungated(id).await
    }

    async fn resume_ungated(self: &Arc<Self>, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let _g = self.acquire(id, Op::Resume, Who::User).await?;
        let mut rec = self.record(id).await?;
        self.touch(id);
        let next = rec.state.apply(Op::Resume)?;
        self.begin(&mut rec, Op::Resume, None).await?;
        let result = if rec.state == SandboxState::Hibernated {
            let id2 = id.clone();
            match self.db(move |s| s.latest_ready_snapshot(&id2)).await? {
                Some(snap) => {
                    let started = Instant::now();
                    let r = self.engine.wake(id, &snap.id).await;
                    if r.is_ok() {
                        self.metrics.observe_step(step::RESTORE, started.elapsed());
                    }
                    r.map(Some)
                }
                None => Err(EngineError::SnapshotNotFound(format!(
                    "(no snapshot to wake {id} from)"
                ))),
            }
        } else {
            self.engine.resume(id).await.map(|()| None)
        };
        match result {
            Ok(vm) => {
                if let Some(vm) = vm {
                    rec.pid = Some(vm.pid);
                }
                rec.last_activity_at = self.now();
                self.done(&mut rec, Op::Resume, next, &[], None).await?;
                Ok(rec)
            }
            Err(e) => {
                self.failed(&mut rec, Op::Resume, &e, &[]).await;
                Err(e.into())
            }
        }
    }

    /// Hibernates a sandbox (snapshot, then the VM ends).
    pub async fn hibernate(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        self.authorize_on(caller, id, lifecycle("hibernate"), opts)
            .await?;
        let g = self.acquire(id, Op::Hibernate, Who::User).await?;
        self.hibernate_locked(id, g).await
    }

    async fn hibernate_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        _g: OpGuard,
    ) -> ServiceResult<SandboxRecord> {
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Hibernate)?;
        let mut snap = self.new_snapshot(&rec, SnapshotKind::Hibernate, None);
        rec.pending_op = Some(Op::Hibernate);
        rec.updated_at = self.now();
        {
            let (r, s) = (rec.clone(), snap.clone());
            let ev = Event::new(
                &rec,
                Op::Hibernate,
                Some(rec.state),
                EventPhase::Pending,
                Some(snap.id.to_string()),
                self.now(),
            );
            self.db(move |st| st.commit(&[&r], &[&s], Some(&ev)))
                .await?;
        }
        let started = Instant::now();
        match self.engine.hibernate(id, &snap.id).await {
            Ok(info) => {
                self.metrics
                    .observe_step(step::HIBERNATE, started.elapsed());
                self.observe_snapshot(started, &info);
                Self::ready(&mut snap, &info);
                self.done(
                    &mut rec,
                    Op::Hibernate,
                    next,
                    &[&snap],
                    Some(snap.id.to_string()),
                )
                .await?;
                self.spawn_usage(snap.id.clone());
                Ok(rec)
            }
            Err(e) => {
                Self::dropped(&mut snap, format!("hibernate failed: {e}"));
                self.failed(&mut rec, Op::Hibernate, &e, &[&snap]).await;
                Err(e.into())
            }
        }
    }

    /// Takes a snapshot (waking a hibernated sandbox first).
    pub async fn take_snapshot(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: TakeSnapshot,
        opts: &GateOptions,
    ) -> ServiceResult<SnapshotRecord> {
        self.get_sandbox(caller, id).await?;
        if cmd
            .label
            .as_ref()
            .is_some_and(|l| l.len() > 255 || l.contains('\0'))
        {
            return Err(ServiceError::InvalidRequest(
                "label: at most 255 bytes, no NUL".into(),
            ));
        }
        self.authorize(caller, Some(id), CallKind::Snapshot, opts)
            .await?;
        self.ensure_awake(id).await?;
        let g = self.acquire(id, Op::Snapshot, Who::User).await?;
        self.snapshot_locked(id, SnapshotKind::Manual, cmd.label, g)
            .await
    }

    async fn snapshot_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        kind: SnapshotKind,
        label: Option<String>,
        _g: OpGuard,
    ) -> ServiceResult<SnapshotRecord> {
        let rec = self.record(id).await?;
        rec.state.apply(Op::Snapshot)?;
        let mut snap = self.new_snapshot(&rec, kind, label);
        {
            let s = snap.clone();
            let ev = Event::new(
                &rec,
                Op::Snapshot,
                Some(rec.state),
                EventPhase::Pending,
                Some(snap.id.to_string()),
                self.now(),
            );
            self.db(move |st| st.commit(&[], &[&s], Some(&ev))).await?;
        }
        let started = Instant::now();
        let result = self.engine.snapshot(id, &snap.id).await;
        let (phase, detail) = match &result {
            Ok(info) => {
                self.observe_snapshot(started, info);
                Self::ready(&mut snap, info);
                (EventPhase::Done, snap.id.to_string())
            }
            Err(e) => {
                Self::dropped(&mut snap, format!("snapshot failed: {e}"));
                self.metrics.count("snapshot_failed");
                (EventPhase::Failed, format!("{}: {e}", snap.id))
            }
        };
        let s = snap.clone();
        let ev = Event::new(
            &rec,
            Op::Snapshot,
            Some(rec.state),
            phase,
            Some(detail),
            self.now(),
        );
        self.db(move |st| st.commit(&[], &[&s], Some(&ev))).await?;
        match result {
            Ok(_) => {
                self.spawn_usage(snap.id.clone());
                Ok(snap)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A sandbox's snapshots, oldest first.
    pub async fn list_snapshots(
        &self,
        caller: &Caller,
        id: &SandboxId,
    ) -> ServiceResult<Vec<SnapshotRecord>> {
        self.get_sandbox(caller, id).await?;
        let id = id.clone();
        self.db(move |s| s.list_snapshots(&id, false)).await
    }

    /// One snapshot the caller may see that is not deleted (another
    /// tenant's answers like an unknown id).
    pub async fn get_snapshot(
        &self,
        caller: &Caller,
        id: &SnapshotId,
    ) -> ServiceResult<SnapshotRecord> {
        match self.snapshot_record(id).await {
            Ok(r) if caller.sees(&r.tenant) => Ok(r),
            Ok(_) => Err(not_found("snapshot", id)),
            Err(e) => Err(e),
        }
    }

    /// Deletes a snapshot (recorded first, then removed from the pool).
    pub async fn delete_snapshot(
        &self,
        caller: &Caller,
        id: &SnapshotId,
        opts: &GateOptions,
    ) -> ServiceResult<SnapshotRecord> {
        let snap = self.get_snapshot(caller, id).await?;
        self.authorize(
            caller,
            Some(&snap.sandbox_id),
            lifecycle("delete_snapshot"),
            opts,
        )
        .await?;
        let mut snap = self.snapshot_record(id).await?;
        if snap.status == SnapshotStatus::Pending {
            return Err(ServiceError::Conflict(format!(
                "snapshot {id} is being taken"
            )));
        }
        Self::dropped(&mut snap, "deleted by user".into());
        let s = snap.clone();
        self.db(move |st| st.put_snapshot(&s)).await?;
        if let Err(e) = self.engine.delete_snapshot(id).await {
            warn!(snapshot = %id, error = %e, "removing snapshot failed; recovery will retry");
        }
        Ok(snap)
    }

    /// Forks the present state of a sandbox into a new one.
    pub async fn fork_sandbox(
        self: &Arc<Self>,
        caller: &Caller,
        src: &SandboxId,
        spec: SandboxSpec,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let src_rec = self.authorize_on(caller, src, CallKind::Fork, opts).await?;
        self.touch(src);
        if matches!(
            src_rec.state,
            SandboxState::Hibernated | SandboxState::Failed
        ) {
            // Its present state is its latest snapshot: fork that, no wake needed.
            let src2 = src.clone();
            let snap = self
                .db(move |s| s.latest_ready_snapshot(&src2))
                .await?
                .ok_or_else(|| {
                    ServiceError::InvalidStateOther(format!(
                        "sandbox {src} has no snapshot to fork"
                    ))
                })?;
            return self.fork_snapshot_ungated(caller, &snap.id, spec).await;
        }
        let _g = self.acquire(src, Op::Fork, Who::User).await?;
        let src_rec = self.record(src).await?;
        src_rec.state.apply(Op::Fork)?;
        let size = spec.size.over(src_rec.size);
        size.validate()?;
        check_source_size(&format!("sandbox {src}"), src_rec.size, size)?;
        let mut rec = self.new_record(caller.owner(), &spec, size)?;
        rec.template = src_rec.template.clone();
        let mut snap = self.new_snapshot(&src_rec, SnapshotKind::Fork, None);
        rec.source_snapshot = Some(snap.id.clone());
        let span = tracing::info_span!("fork", sandbox = %rec.id, source = %src);
        async move {
            {
                let _placement = self.placement.lock().await;
                self.check_capacity(size).await?;
                self.begin_create(&rec, &snap, format!("fork of {src} via {}", snap.id))
                    .await?;
            }
            let started = Instant::now();
            match self.engine.fork_live(src, &snap.id, &rec.id, size).await {
                Ok((info, vm)) => {
                    self.metrics.observe_step(step::RESTORE, started.elapsed());
                    self.observe_snapshot(started, &info);
                    Self::ready(&mut snap, &info);
                    rec.pid = Some(vm.pid);
                    rec.accel = Some(vm.accel);
                    self.done(&mut rec, Op::Created, SandboxState::Running, &[&snap], None)
                        .await?;
                    self.spawn_usage(snap.id.clone());
                    Ok(rec)
                }
                Err(e) => {
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, snap, format!("fork failed: {e}"), &e)
                        .await;
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Forks a snapshot into a new sandbox.
    pub async fn fork_snapshot(
        self: &Arc<Self>,
        caller: &Caller,
        snap: &SnapshotId,
        spec: SandboxSpec,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let s = self.get_snapshot(caller, snap).await?;
        self.authorize(caller, Some(&s.sandbox_id), CallKind::Fork, opts)
            .await?;
        self.fork_snapshot_ungated(caller, snap, spec).await
    }

    async fn fork_snapshot_ungated(
        self: &Arc<Self>,
        caller: &Caller,
        snap: &SnapshotId,
        spec: SandboxSpec,
    ) -> ServiceResult<SandboxRecord> {
        let s = self.snapshot_record(snap).await?;
        if s.status != SnapshotStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "snapshot {snap} is not ready"
            )));
        }
        let src_id = s.sandbox_id.clone();
        let src = self.db(move |st| st.get_sandbox(&src_id)).await?;
        let base = src
            .as_ref()
            .map(|r| r.size)
            .unwrap_or(self.config.default_size);
        let size = spec.size.over(base);
        size.validate()?;
        if src.is_some() {
            check_source_size(&format!("snapshot {snap}"), base, size)?;
        }
        let mut rec = self.new_record(caller.owner(), &spec, size)?;
        rec.template = src.and_then(|r| r.template);
        rec.source_snapshot = Some(snap.clone());
        self.spawn_new(rec, Source::Snapshot(snap.clone()), step::RESTORE)
            .await
    }

    /// Returns a sandbox to one of its snapshots (by id or by time ago).
    pub async fn rewind(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: Rewind,
        opts: &GateOptions,
    ) -> ServiceResult<(SandboxRecord, SnapshotRecord, Option<SnapshotRecord>)> {
        self.get_sandbox(caller, id).await?;
        let target = match (&cmd.to, &cmd.ago) {
            (Some(to), None) => {
                let t = self.get_snapshot(caller, to).await?;
                if &t.sandbox_id != id {
                    // Names no other sandbox: the snapshot may be anyone's.
                    return Err(ServiceError::InvalidRequest(format!(
                        "snapshot {to} is not a snapshot of {id}: rewind goes to a sandbox's own snapshots (fork it instead)"
                    )));
                }
                t
            }
            (None, Some(ago)) => {
                let d = crate::duration::parse_duration(ago)
                    .map_err(|e| ServiceError::InvalidRequest(format!("ago: {e}")))?;
                let at = self.now()
                    - chrono::Duration::from_std(d)
                        .map_err(|_| ServiceError::InvalidRequest("ago: too large".into()))?;
                let id2 = id.clone();
                self.db(move |s| s.ready_snapshot_at(&id2, at)).await?.ok_or_else(|| {
                    ServiceError::NotFound {
                        kind: "snapshot",
                        id: format!(
                            "of {id} at or before {} ({ago} ago; retention keeps rolling snapshots for {})",
                            at.to_rfc3339(),
                            crate::duration::format_duration(self.config.retention.horizon())
                        ),
                    }
                })?
            }
            _ => {
                return Err(ServiceError::InvalidRequest(
                    "give exactly one of `to` (snapshot id) or `ago` (e.g. \"10m\")".into(),
                ))
            }
        };
        if target.status != SnapshotStatus::Ready {
            return Err(ServiceError::InvalidStateOther(format!(
                "snapshot {} is not ready",
                target.id
            )));
        }
        self.authorize(caller, Some(id), CallKind::Rewind, opts)
            .await?;
        let _g = self.acquire(id, Op::Rewind, Who::User).await?;
        let mut rec = self.record(id).await?;
        self.touch(id);
        let next = rec.state.apply(Op::Rewind)?;
        let mut pre = rec.state.has_vm().then(|| {
            self.new_snapshot(
                &rec,
                SnapshotKind::PreRewind,
                Some(format!("before rewind to {}", target.id)),
            )
        });
        rec.pending_op = Some(Op::Rewind);
        rec.updated_at = self.now();
        {
            let ev = Event::new(
                &rec,
                Op::Rewind,
                Some(next),
                EventPhase::Pending,
                Some(target.id.to_string()),
                self.now(),
            );
            let (r, p) = (rec.clone(), pre.clone());
            self.db(move |st| {
                let snaps: Vec<&SnapshotRecord> = p.iter().collect();
                st.commit(&[&r], &snaps, Some(&ev))
            })
            .await?;
        }
        let started = Instant::now();
        let result = self
            .engine
            .rewind(id, &target.id, pre.as_ref().map(|p| &p.id))
            .await;
        match result {
            Ok((info, vm)) => {
                self.metrics.observe_step(step::RESTORE, started.elapsed());
                if let (Some(p), Some(info)) = (pre.as_mut(), info.as_ref()) {
                    Self::ready(p, info);
                    self.metrics.observe_step(
                        step::SNAPSHOT_PAUSE,
                        Duration::from_secs_f64(info.pause_ms.max(0.0) / 1000.0),
                    );
                } else if let Some(p) = pre.as_mut() {
                    Self::dropped(p, "engine took no pre-rewind snapshot".into());
                }
                rec.pid = Some(vm.pid);
                rec.last_activity_at = self.now();
                let snaps: Vec<&SnapshotRecord> = pre.iter().collect();
                self.done(
                    &mut rec,
                    Op::Rewind,
                    next,
                    &snaps,
                    Some(target.id.to_string()),
                )
                .await?;
                if let Some(p) = pre.as_ref().filter(|p| p.status == SnapshotStatus::Ready) {
                    self.spawn_usage(p.id.clone());
                }
                Ok((
                    rec,
                    target,
                    pre.filter(|p| p.status == SnapshotStatus::Ready),
                ))
            }
            Err(e) => {
                if let Some(p) = pre.as_mut() {
                    Self::dropped(p, format!("rewind failed: {e}"));
                }
                let snaps: Vec<&SnapshotRecord> = pre.iter().collect();
                self.failed(&mut rec, Op::Rewind, &e, &snaps).await;
                Err(e.into())
            }
        }
    }

    /// Runs a command; the stream ends with the exit event.
    pub async fn exec(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        req: ExecRequest,
        opts: &GateOptions,
    ) -> ServiceResult<ExecStream> {
        self.get_sandbox(caller, id).await?;
        validate_exec(&req)?;
        let kind = CallKind::Exec {
            argv: req.cmd.clone(),
            shell: None,
        };
        self.authorize(caller, Some(id), kind, opts).await?;
        self.exec_granted(id, req).await
    }

    async fn exec_granted(
        self: &Arc<Self>,
        id: &SandboxId,
        req: ExecRequest,
    ) -> ServiceResult<ExecStream> {
        let rec = self.ensure_awake(id).await?;
        rec.state.apply(Op::Exec)?;
        let started = Instant::now();
        let stream = self.engine.exec(id, req).await?;
        let metrics = self.metrics.clone();
        Ok(stream
            .inspect(move |ev| {
                if let Ok(ExecEvent::Exit { .. }) = ev {
                    metrics.observe_step(step::EXEC_ROUND_TRIP, started.elapsed());
                }
            })
            .boxed())
    }

    async fn guest_ready(
        self: &Arc<Self>,
        g: &Grant,
        op: GuestOp,
        path: &str,
    ) -> ServiceResult<SandboxId> {
        validate_guest_path(path)?;
        if !g.covers(op, path) {
            // A front door passed a path its grant was not decided for.
            return Err(ServiceError::Forbidden(format!(
                "{op:?} of {path} is not covered by the call the gate decided"
            )));
        }
        let rec = self.ensure_awake(&g.sandbox).await?;
        rec.state.apply(Op::Exec)?;
        Ok(rec.id)
    }

    /// Gates a tool call of `caller` on its sandbox `id` and returns the
    /// grant the guest operations run under ([`Service::read_file`] …).
    /// The call is built by the front door from the values it will use.
    pub async fn grant(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<Grant> {
        self.authorize_on(caller, id, kind.clone(), opts).await?;
        Ok(Grant {
            sandbox: id.clone(),
            caller: caller.clone(),
            kind: Some(kind),
        })
    }

    /// Access to the caller's sandbox `id` without a tool call: only for a
    /// front door's own helper commands ([`Service::exec_helper`]) that
    /// serve calls already decided (an E2B process's signals and stdin).
    pub async fn access(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<Grant> {
        self.get_sandbox(caller, id).await?;
        Ok(Grant {
            sandbox: id.clone(),
            caller: caller.clone(),
            kind: None,
        })
    }

    /// Runs a front door's helper command under a grant (the E2B door's
    /// process wrapper, `mv` for a move, `kill` for a signal): the gate
    /// already decided the call it serves.
    pub async fn exec_helper(
        self: &Arc<Self>,
        g: &Grant,
        req: ExecRequest,
    ) -> ServiceResult<ExecStream> {
        validate_exec(&req)?;
        self.exec_granted(&g.sandbox, req).await
    }

    /// Streams a guest file.
    pub async fn read_file(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<ByteStream> {
        let id = self.guest_ready(g, GuestOp::Read, path).await?;
        Ok(self.engine.read_file(&id, path).await?)
    }

    /// Writes a guest file from a stream.
    pub async fn write_file(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        if mode > 0o7777 {
            return Err(ServiceError::InvalidRequest(format!(
                "mode {mode:o}: at most 7777 (octal)"
            )));
        }
        let id = self.guest_ready(g, GuestOp::Write, path).await?;
        Ok(self.engine.write_file(&id, path, mode, body).await?)
    }

    /// Lists a guest directory.
    pub async fn list_dir(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<Vec<FileStat>> {
        let id = self.guest_ready(g, GuestOp::List, path).await?;
        Ok(self.engine.list_dir(&id, path).await?)
    }

    /// Stats a guest path.
    pub async fn stat(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<FileStat> {
        let id = self.guest_ready(g, GuestOp::Stat, path).await?;
        Ok(self.engine.stat(&id, path).await?)
    }

    /// Makes a guest directory.
    pub async fn mkdir(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        parents: bool,
    ) -> ServiceResult<()> {
        let id = self.guest_ready(g, GuestOp::Mkdir, path).await?;
        Ok(self.engine.mkdir(&id, path, parents).await?)
    }

    /// Removes a guest path.
    pub async fn remove(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        recursive: bool,
    ) -> ServiceResult<()> {
        if path.trim_end_matches('/').is_empty() {
            return Err(ServiceError::InvalidRequest("refusing to remove /".into()));
        }
        let id = self.guest_ready(g, GuestOp::Remove, path).await?;
        Ok(self.engine.remove(&id, path, recursive).await?)
    }

    /// The journal of one of the caller's sandboxes.
    pub async fn events(
        &self,
        caller: &Caller,
        id: &SandboxId,
        limit: usize,
    ) -> ServiceResult<Vec<Event>> {
        self.get_sandbox(caller, id).await?;
        let id = id.clone();
        self.db(move |s| s.events(&id, limit.clamp(1, 1000))).await
    }

    /// Starts a template build; returns at once with the `building` record.
    pub async fn build_template(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: BuildTemplate,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateView> {
        let size = cmd.size.over(self.config.default_size);
        size.validate()?;
        if !caller.is_system()
            && cmd
                .id
                .as_ref()
                .is_some_and(|i| i.as_str() == DEFAULT_TEMPLATE)
        {
            return Err(ServiceError::Forbidden(format!(
                "template id {DEFAULT_TEMPLATE} is reserved for the platform"
            )));
        }
        self.authorize(caller, None, lifecycle("build_template"), opts)
            .await?;
        let id = cmd.id.unwrap_or_else(TemplateId::generate);
        let id2 = id.clone();
        if let Some(t) = self.db(move |s| s.get_template(&id2)).await? {
            if t.tenant != caller.owner() {
                // Ids are global: one once used by another owner (the
                // platform's included) stays theirs, whatever its status.
                return Err(ServiceError::Conflict(format!("template id {id} is taken")));
            }
            if t.status == TemplateStatus::Failed {
                // A failed build may have left parts behind; a rebuild starts clean.
                let _ = self.engine.delete_template(&id).await;
            } else if t.status != TemplateStatus::Deleted {
                return Err(ServiceError::Conflict(format!(
                    "template {id} exists ({})",
                    t.status.as_str()
                )));
            }
        }
        let now = self.now();
        let rec = TemplateRecord {
            id: id.clone(),
            tenant: caller.owner().to_owned(),
            name: cmd.name,
            size,
            status: TemplateStatus::Building,
            status_reason: None,
            accel: None,
            created_at: now,
            updated_at: now,
        };
        let r = rec.clone();
        self.db(move |s| s.put_template(&r)).await?;
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id.clone(),
                BuildProgress {
                    step: "starting".into(),
                    fraction: None,
                },
            );
        let this = self.clone();
        let mut rec2 = rec.clone();
        tokio::spawn(
            async move {
                let weak = Arc::downgrade(&this);
                let tid = rec2.id.clone();
                let sink: crate::engine::ProgressSink =
                    Arc::new(move |step: &str, fraction: Option<f32>| {
                        if let Some(s) = weak.upgrade() {
                            s.progress.lock().unwrap_or_else(|p| p.into_inner()).insert(
                                tid.clone(),
                                BuildProgress {
                                    step: step.to_owned(),
                                    fraction,
                                },
                            );
                        }
                    });
                let result = this.engine.build_template(&rec2.id, rec2.size, sink).await;
                match result {
                    Ok(info) => {
                        rec2.status = TemplateStatus::Ready;
                        rec2.accel = Some(info.accel);
                        info!(build_ms = info.build_ms, "template ready");
                    }
                    Err(e) => {
                        warn!(error = %e, "template build failed");
                        rec2.status = TemplateStatus::Failed;
                        rec2.status_reason = Some(e.to_string());
                    }
                }
                rec2.updated_at = this.now();
                this.progress
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec2.id);
                let r = rec2.clone();
                if let Err(e) = this.db(move |s| s.put_template(&r)).await {
                    warn!(error = %e.message(), "recording template failed");
                }
            }
            .instrument(tracing::info_span!("template", template = %id)),
        );
        Ok(self.template_view(rec))
    }

    fn template_view(&self, record: TemplateRecord) -> TemplateView {
        let progress = self
            .progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&record.id)
            .cloned();
        TemplateView { record, progress }
    }

    /// Templates not deleted that the caller may use: the platform's and
    /// its tenant's (the daemon: all).
    pub async fn list_templates(&self, caller: &Caller) -> ServiceResult<Vec<TemplateView>> {
        let tenant = caller.tenant().map(str::to_owned);
        let v = self
            .db(move |s| match tenant {
                None => s.all_templates(),
                Some(t) => {
                    let mut v = s.list_templates(PLATFORM_SCOPE)?;
                    v.extend(s.list_templates(&t)?);
                    v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
                    Ok(v)
                }
            })
            .await?;
        Ok(v.into_iter().map(|r| self.template_view(r)).collect())
    }

    /// One template the caller may use (another tenant's answers like an
    /// unknown id).
    pub async fn get_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
    ) -> ServiceResult<TemplateView> {
        match self.template_record(id).await {
            Ok(r) if caller.sees_template(&r.tenant) => Ok(self.template_view(r)),
            Ok(_) => Err(not_found("template", id)),
            Err(e) => Err(e),
        }
    }

    /// Deletes one of the caller's templates (sandboxes made from it are
    /// independent). Platform templates are deleted by no tenant.
    pub async fn delete_template(
        &self,
        caller: &Caller,
        id: &TemplateId,
        opts: &GateOptions,
    ) -> ServiceResult<TemplateView> {
        let v = self.get_template(caller, id).await?;
        if v.record.tenant != caller.owner() {
            return Err(ServiceError::Forbidden(format!(
                "template {id} belongs to the platform; no tenant may delete it"
            )));
        }
        self.authorize(caller, None, lifecycle("delete_template"), opts)
            .await?;
        let mut v = self.get_template(caller, id).await?;
        if v.record.status == TemplateStatus::Building {
            return Err(ServiceError::Conflict(format!(
                "template {id} is being built"
            )));
        }
        v.record.status = TemplateStatus::Deleted;
        v.record.updated_at = self.now();
        let r = v.record.clone();
        self.db(move |s| s.put_template(&r)).await?;
        if let Err(e) = self.engine.delete_template(id).await {
            warn!(template = %id, error = %e, "removing template failed; recovery will retry");
        }
        Ok(v)
    }

    /// Applies retention to one sandbox's snapshots.
    pub async fn gc(&self, id: &SandboxId) -> ServiceResult<usize> {
        let id2 = id.clone();
        let snaps = self.db(move |s| s.list_snapshots(&id2, false)).await?;
        let points: Vec<Point<SnapshotId>> = snaps
            .iter()
            .filter(|s| s.status == SnapshotStatus::Ready)
            .map(|s| Point {
                id: s.id.clone(),
                at: s.created_at,
                kind: s.kind,
            })
            .collect();
        let doomed = self.config.retention.to_delete(&points, self.now());
        if doomed.is_empty() {
            return Ok(0);
        }
        let mut recs: Vec<SnapshotRecord> = snaps
            .into_iter()
            .filter(|s| doomed.contains(&s.id))
            .collect();
        for r in &mut recs {
            Self::dropped(r, "retention".into());
        }
        let rs = recs.clone();
        // Recorded as deleted first: a crash before removal leaves an orphan
        // subvolume (cleaned by recovery), never a listed snapshot that is gone.
        self.db(move |st| {
            let refs: Vec<&SnapshotRecord> = rs.iter().collect();
            st.commit(&[], &refs, None)
        })
        .await?;
        for r in &recs {
            if let Err(e) = self.engine.delete_snapshot(&r.id).await {
                warn!(sandbox = %id, snapshot = %r.id, error = %e, "GC removal failed; recovery will retry");
            }
        }
        Ok(recs.len())
    }

    /// Restores a failed sandbox from its latest ready snapshot.
    pub async fn recover(&self, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Recover)?;
        let id2 = id.clone();
        let Some(snap) = self.db(move |s| s.latest_ready_snapshot(&id2)).await? else {
            rec.state_reason = Some(format!(
                "{}; no snapshot to restore from",
                rec.state_reason.clone().unwrap_or_default()
            ));
            let from = rec.state;
            self.save(
                &rec,
                Op::Recover,
                from,
                EventPhase::Failed,
                Some("no snapshot".into()),
            )
            .await?;
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} has no snapshot to restore from"
            )));
        };
        self.begin(&mut rec, Op::Recover, Some(snap.id.to_string()))
            .await?;
        let started = Instant::now();
        match self.engine.restore(id, &snap.id).await {
            Ok(vm) => {
                self.metrics.observe_step(step::RESTORE, started.elapsed());
                rec.pid = Some(vm.pid);
                rec.accel = Some(vm.accel);
                self.done(
                    &mut rec,
                    Op::Recover,
                    next,
                    &[],
                    Some(format!("restored from {}", snap.id)),
                )
                .await?;
                info!(sandbox = %id, snapshot = %snap.id, "restored from latest snapshot");
                Ok(rec)
            }
            Err(e) => {
                self.failed(&mut rec, Op::Recover, &e, &[]).await;
                Err(e.into())
            }
        }
    }

    /// A VM died behind the daemon's back: mark failed, then restore.
    pub async fn handle_exit(self: &Arc<Self>, id: &SandboxId, reason: &str) {
        let span = tracing::info_span!("vm_exit", sandbox = %id);
        async {
            let Ok(_g) = self.acquire(id, Op::Fail, Who::User).await else {
                // A user operation holds the sandbox; it sees the failure itself.
                warn!(reason, "vm exited during another operation");
                return;
            };
            let Ok(mut rec) = self.record(id).await else {
                return;
            };
            let Ok(next) = rec.state.apply(Op::Fail) else {
                return;
            };
            warn!(reason, "vm died");
            let from = rec.state;
            rec.state = next;
            rec.pid = None;
            rec.pending_op = None;
            rec.state_reason = Some(format!("vm died: {reason}"));
            rec.updated_at = self.now();
            if let Err(e) = self
                .save(
                    &rec,
                    Op::Fail,
                    from,
                    EventPhase::Done,
                    Some(reason.to_owned()),
                )
                .await
            {
                warn!(error = %e.message(), "recording the failure failed");
            }
            self.sched.remove(id);
            self.metrics.count("vm_died");
            if self.config.auto_recover {
                if let Err(e) = self.recover(id).await {
                    warn!(error = %e.message(), "recovery failed");
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Consumes the engine's exit events until it closes the stream.
    pub fn spawn_exit_watcher(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let mut rx = self.engine.exit_events();
        let this = self.clone();
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                this.handle_exit(&ev.id, &ev.reason).await;
            }
        })
    }

    /// Counts for metrics and stats.
    pub async fn refresh_gauges(&self) -> ServiceResult<StoreCounts> {
        let c = self.db(|s| s.counts(None)).await?;
        self.metrics
            .set_counts(&c.sandboxes_by_state, c.snapshots_ready);
        Ok(c)
    }

    /// Counts of the caller's tenant (the daemon: all).
    pub async fn counts(&self, caller: &Caller) -> ServiceResult<StoreCounts> {
        let t = caller.tenant().map(str::to_owned);
        self.db(move |s| s.counts(t.as_deref())).await
    }

    /// Sets one of the caller's sandboxes' idle timeout (the E2B door's
    /// `timeout`) and counts as activity. Bounded: at most a year.
    pub async fn set_idle_timeout(
        &self,
        caller: &Caller,
        id: &SandboxId,
        timeout_s: u64,
    ) -> ServiceResult<SandboxRecord> {
        if timeout_s > MAX_IDLE_TIMEOUT_S {
            return Err(ServiceError::InvalidRequest(format!(
                "timeout {timeout_s}s: at most {MAX_IDLE_TIMEOUT_S}s (a year)"
            )));
        }
        self.get_sandbox(caller, id).await?;
        let _g = self.acquire(id, Op::Configure, Who::User).await?;
        let mut rec = self.record(id).await?;
        rec.state.apply(Op::Configure)?;
        rec.idle_timeout_s = Some(timeout_s.max(1));
        rec.last_activity_at = self.now();
        rec.updated_at = self.now();
        let r = rec.clone();
        self.db(move |s| s.update_sandbox(&r, None)).await?;
        self.reschedule(&rec);
        self.touch(id);
        Ok(rec)
    }

    /// Records activity on one of the caller's sandboxes (postpones idle
    /// hibernation).
    pub async fn refresh(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        self.touch(id);
        Ok(())
    }
}

/// The scheduler's view of the service (needs `Arc<Service>` for spawns).
#[derive(Debug, Clone)]
pub struct ScheduledActions(pub Arc<Service>);

#[async_trait]
impl Actions for ScheduledActions {
    async fn rolling_snapshot(&self, id: SandboxId) {
        let svc = &self.0;
        let span = tracing::info_span!("rolling_snapshot", sandbox = %id);
        async {
            let Ok(g) = svc.acquire(&id, Op::Snapshot, Who::Background).await else {
                // Busy: this slot is skipped, the next one comes an interval later.
                return;
            };
            match svc.record(&id).await {
                Ok(r) if r.state == SandboxState::Running => {}
                _ => return,
            }
            if let Err(e) = svc
                .snapshot_locked(&id, SnapshotKind::Rolling, None, g)
                .await
            {
                warn!(error = %e.message(), "rolling snapshot failed");
                return;
            }
            if let Err(e) = svc.gc(&id).await {
                warn!(error = %e.message(), "gc failed");
            }
        }
        .instrument(span)
        .await
    }

    async fn idle_hibernate(&self, id: SandboxId) {
        let svc = &self.0;
        let span = tracing::info_span!("idle_hibernate", sandbox = %id);
        async {
            let Ok(g) = svc.acquire(&id, Op::Hibernate, Who::Background).await else {
                return;
            };
            match svc.hibernate_locked(&id, g).await {
                Ok(_) => info!("hibernated after idle timeout"),
                Err(e) => warn!(error = %e.message(), "idle hibernation failed"),
            }
        }
        .instrument(span)
        .await
    }

    async fn gc_sweep(&self) {
        let mut after: Option<SandboxId> = None;
        loop {
            let a = after.clone();
            let Ok(ids) = self
                .0
                .db(move |s| s.sandboxes_with_snapshots(a.as_ref(), 500))
                .await
            else {
                return;
            };
            let Some(last) = ids.last().cloned() else {
                return;
            };
            for id in ids {
                if let Err(e) = self.0.gc(&id).await {
                    warn!(sandbox = %id, error = %e.message(), "gc failed");
                }
            }
            after = Some(last);
        }
    }
}
