//! The service layer: typed commands over the store and the engine, shared
//! by every front door (the `/v1` API, the E2B door), the scheduler and
//! recovery. Every command takes the [`Caller`]: tenant visibility is decided
//! in its lookups ([`access`]), the tool-call gate by the command with the
//! values the action uses.
//!
//! Every state-changing operation:
//! 1. takes the sandbox's operation lock ([`oplock`]): a second user
//!    operation while one runs gets `409 conflict` at once (no queue); a user
//!    operation arriving during a background one (rolling snapshot) waits
//!    for it, it is short;
//! 2. asks the state machine whether the operation is allowed
//!    (`SandboxState::apply`);
//! 3. records the operation as pending through the transition writer
//!    ([`journal`]: sandbox `pending_op`, snapshot rows `pending`, a journal
//!    entry) before calling the engine;
//! 4. finalizes through the same writer: the new state on success; on
//!    failure the previous state stays, with the reason in `state_reason`
//!    and the journal.
//!
//! A crash between 3 and 4 leaves a pending record that recovery rolls back
//! or completes; a pending snapshot is never listed as ready.

mod access;
mod admission;
mod background;
pub mod build;
mod commands;
mod error;
mod fork;
mod guest;
mod held;
mod journal;
mod lifecycle;
mod logs;
mod moving;
mod oplock;
mod ports;
mod prelude;
mod recovery;
mod replicas;
mod rewind;
mod sampler;
pub mod signing;
mod snapshots;
mod templates;
mod transfer;
mod unchanged;
mod variants;
mod warm;
pub mod watch;

pub use admission::UseBudget;
pub use admission::MAX_CONCURRENT_TEMPLATE_BUILDS;
pub use background::ScheduledActions;
pub use commands::*;
pub use error::*;
pub use guest::{validate_pty, Grant, GuestOp, MAX_PTY_SIDE};
pub use held::{HeldUpload, HELD_UPLOADS_DIR};
pub(crate) use journal::VmNow;
pub use lifecycle::pressure::{PressureReading, PRESSURE_HIBERNATION};
pub use logs::{LogEntry, LogPage, LogStream, LogTap, ProcessLogs, MAX_LOG_PAGE};
pub use moving::{AdoptMove, Adoption, MoveReport, MoveSandbox};
pub(crate) use oplock::*;
pub use ports::{is_port_closed, PortConn};
pub use replicas::{TenantDefaults, REPLICATE_SETTING, TENANT_REPLICATE_SETTING};
pub use sampler::{
    HostPoint, Sample, Sampler, SandboxMetrics, UsageSummary, MAX_POINTS, SAMPLE_STEP,
};
pub use transfer::{
    ExportManifest, ExportedSnapshot, ImportedSnapshot, PullReport, PullSandbox, PushReport,
    PushSandbox, RegisterImport, SentSnapshot, MAX_IMPORT_SNAPSHOTS, MAX_SNAPSHOT_STREAM_BYTES,
};
pub use unchanged::ActivityNote;
pub use warm::WarmPoolStats;

use self::prelude::*;

/// Activity is written to the store at most this often per sandbox.
pub(crate) const ACTIVITY_FLUSH: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

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
    transients: admission::Transients,
    /// Warm guests (`[pools]`).
    warm: warm::WarmPools,
    progress: Mutex<HashMap<TemplateId, BuildProgress>>,
    /// Size-variant builds (`variants`).
    variants: variants::VariantBuilds,
    flushed: Mutex<HashMap<SandboxId, DateTime<Utc>>>,
    /// Each sandbox's last activity, exact (the store has it to within
    /// [`ACTIVITY_FLUSH`]): what pressure-driven hibernation calls idle.
    activity: Mutex<HashMap<SandboxId, DateTime<Utc>>>,
    /// The pressure monitor's state (`lifecycle::pressure`).
    pressure: lifecycle::pressure::PressureState,
    /// Bytes of uploads held for approval (`held`).
    held: held::HeldBytes,
    /// Snapshots received from other deployments, not yet registered
    /// (`transfer`).
    imports: transfer::Imports,
    /// Replications in flight (`replicas`).
    replication: replicas::Replication,
    gate: Arc<dyn ToolGate>,
    sampler: sampler::Sampler,
    /// Baselines and activity of running guests, for rolling snapshots of
    /// unchanged ones ([`unchanged`]).
    unchanged: unchanged::Tracker,
    /// What every sandbox's commands printed (`[logs]`).
    logs: Arc<logs::ProcessLogs>,
    /// The key store (`config.key_dir`), opened on first use: a daemon
    /// that never seals anything never touches the key dir.
    keys: std::sync::OnceLock<Result<Arc<crate::security::keys::KeyStore>, String>>,
    /// Called with the id of every sandbox deleted (by a user or its
    /// timeout): front doors drop what they keep per sandbox.
    deleted_hooks: Mutex<Vec<DeletedHook>>,
    /// Open event streams per tenant (`events::stream`).
    events: crate::events::Hub,
    /// This service, for work that needs an owned handle from `&self`
    /// (admission hibernating an idle sandbox).
    me: std::sync::Weak<Service>,
    /// `[cluster]`: this daemon as one host of several (placement).
    cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
}

/// A callback of [`Service::on_deleted`].
pub type DeletedHook = Arc<dyn Fn(&SandboxId) + Send + Sync>;

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
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
        Arc::new_cyclic(|me| Service {
            me: me.clone(),
            cluster: std::sync::OnceLock::new(),
            events: crate::events::Hub::default(),
            keys: std::sync::OnceLock::new(),
            deleted_hooks: Mutex::new(Vec::new()),
            gate,
            sampler: sampler::Sampler::new(&config.metrics),
            unchanged: unchanged::Tracker::default(),
            logs: Arc::new(logs::ProcessLogs::new(&config.logs)),
            store,
            engine,
            sched: SchedulerHandle::new(),
            metrics,
            config,
            clock,
            slots: Mutex::new(HashMap::new()),
            placement: tokio::sync::Mutex::new(()),
            transients: admission::Transients::default(),
            warm: warm::WarmPools::default(),
            progress: Mutex::new(HashMap::new()),
            variants: variants::VariantBuilds::default(),
            flushed: Mutex::new(HashMap::new()),
            activity: Mutex::new(HashMap::new()),
            pressure: lifecycle::pressure::PressureState::default(),
            held: held::HeldBytes::default(),
            imports: transfer::Imports::default(),
            replication: replicas::Replication::default(),
        })
    }

    /// Registers `hook`, called (synchronously, keep it short) after every
    /// sandbox delete with its id, whoever deleted it.
    pub fn on_deleted(&self, hook: DeletedHook) {
        self.deleted_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Runs the [`Service::on_deleted`] hooks for `id`, and drops the
    /// service's own per-sandbox memory of it.
    pub(super) fn forget_deleted(&self, id: &SandboxId) {
        self.unchanged.forget(id);
        self.flushed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let hooks = self
            .deleted_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for h in hooks {
            h(id);
        }
    }

    /// Makes this service a cluster host's: creates are placed
    /// (`crate::cluster`). Set once, at assembly.
    pub fn set_cluster(&self, c: Arc<crate::cluster::Cluster>) {
        let _ = self.cluster.set(c);
    }

    /// The cluster host, when `[cluster] enabled`.
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::Cluster>> {
        self.cluster.get()
    }

    /// Open event streams per tenant.
    pub fn event_streams(&self) -> &crate::events::Hub {
        &self.events
    }

    /// The store.
    pub fn store_handle(&self) -> &Arc<dyn Store> {
        &self.store
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

    pub(super) fn timing(&self, rec: &SandboxRecord) -> Timing {
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

    /// Records activity: postpones idle hibernation; persisted lazily.
    pub fn touch(&self, id: &SandboxId) {
        let now = self.now();
        self.sched.touch(id, now);
        self.activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), now);
        self.unchanged.touch(id, now);
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

    pub(super) fn new_record(
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
            snapshot_interval_s: match parse_opt_duration(
                &spec.snapshot_interval,
                "snapshot_interval",
            )? {
                Some(t) if t > MAX_IDLE_TIMEOUT_S => {
                    return Err(ServiceError::InvalidRequest(format!(
                        "snapshot_interval: at most {MAX_IDLE_TIMEOUT_S}s (a year)"
                    )))
                }
                t => t,
            },
            created_at: now,
            updated_at: now,
            last_activity_at: now,
            pid: None,
            accel: None,
            deleted_at: None,
            version: 0,
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
}
