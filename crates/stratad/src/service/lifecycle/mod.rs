//! Create, delete, pause, resume (wake), hibernate; sandbox settings; the
//! lifecycle policy: what the idle timeout does (hibernate or delete) and
//! whether use wakes a hibernated sandbox ([`LifecyclePolicy`]); and
//! pressure-driven hibernation ([`pressure`]), which hibernates idle
//! sandboxes before the idle timeout when the host runs short.

use super::prelude::*;

pub(crate) mod pressure;

impl Service {
    /// Creates a sandbox from a template. vCPUs and memory are the template's
    /// (a snapshot restores with the RAM and CPUs it was taken with); the
    /// disk may be larger than the template's (it grows). A create at the
    /// template's size takes a warm guest when its pool has one
    /// (`service::warm`).
    pub async fn create(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let _busy = self.warm.busy();
        let (tpl, rec) = self.admit_create(caller, &cmd, opts).await?;
        let rec = match self.create_from_warm(&tpl, &rec).await? {
            Some(rec) => rec,
            None => {
                self.spawn_new(rec, Source::Template(tpl.id), step::SPAWN)
                    .await?
            }
        };
        self.keep_lifecycle(&rec, cmd.spec.lifecycle, None).await;
        self.keep_replicate(&rec, cmd.spec.replicate).await;
        Ok(rec)
    }

    /// The checks every create makes, in order: the size, the template is
    /// one the caller may use (else `not_found`, as for an unknown id), the
    /// gate (`lifecycle create`), then the template is ready (waiting for a
    /// build in progress); then the new record, of the template's size.
    pub(super) async fn admit_create(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: &CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<(TemplateRecord, SandboxRecord)> {
        let size = cmd.spec.size.over(SandboxSize::default());
        size.validate()?;
        if let Some(t) = &cmd.template {
            self.get_template(caller, t).await?;
        }
        self.authorize(caller, None, lifecycle("create"), opts)
            .await?;
        let mut tpl = self.resolve_template(caller, cmd.template.as_ref()).await?;
        let size = cmd.spec.size.over(tpl.size);
        size.validate()?;
        // An API process places the create on a host and forwards it there:
        // the chosen host builds or picks the size variant.
        let api = self.cluster().is_some_and(|c| c.is_api());
        if variants::needs_variant(tpl.size, size) && !api {
            // Another vCPU count or memory: a fork of the template's
            // variant of that size, built first if need be.
            tpl = match self.variant(&tpl, size).await? {
                variants::Variant::Ready(v) => v,
                variants::Variant::Building(v) if cmd.wait => {
                    let deadline = Instant::now() + self.config.templates.variant_wait;
                    self.wait_variant(&v.record.id, deadline).await?
                }
                variants::Variant::Building(v) => {
                    return Err(ServiceError::VariantBuilding(Box::new(v)))
                }
            };
        }
        if !api {
            check_source_size(&format!("template {}", tpl.id), tpl.size, size)?;
        }
        let mut rec = self.new_record(caller.owner(), &cmd.spec, size)?;
        rec.template = Some(tpl.id.clone());
        if let Some(c) = self.cluster() {
            c.check_placement(self, &rec).await?;
            // Placed here: the template's subvolume must be here too
            // (fetched from a live host that holds it when it is not).
            c.ensure_template(self, &tpl).await?;
        }
        Ok((tpl, rec))
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
        let (tpl, mut rec) = self.admit_create(caller, &cmd, opts).await?;
        let span = tracing::info_span!("create_hibernated", sandbox = %rec.id);
        async move {
            let mut snap = self.new_snapshot(&rec, SnapshotKind::Hibernate, None);
            {
                // Recorded first, both pending: a crash before the end is
                // rolled back by recovery (sandbox deleted, snapshot removed).
                let _count = self.admit_without_vm(&rec).await?;
                self.begin_create(
                    &mut rec,
                    Some(&snap),
                    Some(format!("start=false, wake snapshot {}", snap.id)),
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
                        None,
                        &[&snap],
                        Some(format!("hibernated, wakes from {}", snap.id)),
                    )
                    .await?;
                    self.spawn_usage(snap.id.clone());
                    self.keep_lifecycle(&rec, cmd.spec.lifecycle, None).await;
                    self.keep_replicate(&rec, cmd.spec.replicate).await;
                    self.replicate_later(&rec.id);
                    info!(snapshot = %snap.id, "sandbox created hibernated");
                    Ok(rec)
                }
                Err(e) => {
                    let why = e.message();
                    warn!(error = %why, "create (hibernated) failed");
                    let _ = self.engine.delete_snapshot(&snap.id).await;
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, Some(snap), format!("create failed: {why}"), &why)
                        .await;
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Records a new sandbox as creating, starts its VM, finalizes.
    pub(super) async fn spawn_new(
        &self,
        mut rec: SandboxRecord,
        source: Source,
        step_name: &str,
    ) -> ServiceResult<SandboxRecord> {
        let span = tracing::info_span!("create", sandbox = %rec.id);
        let _busy = self.warm.busy();
        async move {
            {
                let _room = self.admit(&rec).await?;
                self.begin_create(&mut rec, None, None).await?;
            }
            let started = Instant::now();
            match self.engine.create(&rec.id, &source, rec.size).await {
                Ok(vm) => {
                    self.metrics.observe_step(step_name, started.elapsed());
                    self.done(
                        &mut rec,
                        Op::Created,
                        SandboxState::Running,
                        Some(VmNow::of(&vm)),
                        &[],
                        None,
                    )
                    .await?;
                    info!(pid = vm.pid, ready_ms = vm.ready_ms, "sandbox running");
                    Ok(rec)
                }
                Err(e) => {
                    let why = e.message();
                    warn!(error = %why, "create failed");
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, None, format!("create failed: {why}"), &why)
                        .await;
                    Err(e.into())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Makes sure a sandbox runs for a guest call (exec, files): wakes it
    /// from hibernation when its policy lets use wake it (`auto_resume`);
    /// else answers [`RuntimeError::NotRunning`] and leaves it asleep.
    pub(super) async fn ensure_awake(
        self: &Arc<Self>,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
        let rec = self.record(id).await?;
        if rec.state == SandboxState::Hibernated && !self.may_auto_resume(id).await? {
            return Err(RuntimeError::NotRunning { id: id.to_string() }.into());
        }
        self.wake_if_hibernated(rec).await
    }

    /// Makes sure a sandbox runs, waking it from hibernation whatever its
    /// policy (a command that names the sandbox itself: a manual snapshot).
    pub(super) async fn ensure_awake_explicit(
        self: &Arc<Self>,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
        let rec = self.record(id).await?;
        self.wake_if_hibernated(rec).await
    }

    async fn wake_if_hibernated(
        self: &Arc<Self>,
        rec: SandboxRecord,
    ) -> ServiceResult<SandboxRecord> {
        self.touch(&rec.id);
        if rec.state == SandboxState::Hibernated {
            return self.resume_ungated(&rec.id).await;
        }
        Ok(rec)
    }

    /// Keeps the lifecycle policy of the new sandbox `rec`: the one asked,
    /// else its source's (`from`: a fork's source sandbox), else none (the
    /// default). A failed write is logged: the sandbox then has the
    /// default, which keeps it (hibernates) and wakes on use.
    pub(super) async fn keep_lifecycle(
        &self,
        rec: &SandboxRecord,
        asked: Option<LifecyclePolicy>,
        from: Option<&SandboxId>,
    ) {
        let policy = match (asked, from) {
            (Some(p), _) => Some(p),
            (None, Some(src)) => match self.stored_lifecycle(src).await {
                Ok(p) => Some(p),
                Err(e) => {
                    warn!(sandbox = %rec.id, source = %src, error = %e.message(), "reading the source's lifecycle policy failed");
                    None
                }
            },
            (None, None) => None,
        };
        let Some(policy) = policy.filter(|p| *p != LifecyclePolicy::default()) else {
            return;
        };
        let id = rec.id.clone();
        if let Err(e) = self
            .db(move |s| s.put_sandbox_lifecycle(&id, &policy))
            .await
        {
            warn!(sandbox = %rec.id, error = %e.message(), "keeping the lifecycle policy failed");
        }
    }

    /// The lifecycle policy kept with sandbox `id` (the default when none).
    pub(super) async fn stored_lifecycle(&self, id: &SandboxId) -> ServiceResult<LifecyclePolicy> {
        let id = id.clone();
        Ok(self
            .db(move |s| s.sandbox_lifecycle(&id))
            .await?
            .unwrap_or_default())
    }

    /// The lifecycle policy of one of the caller's sandboxes.
    pub async fn lifecycle_policy(
        &self,
        caller: &Caller,
        id: &SandboxId,
    ) -> ServiceResult<LifecyclePolicy> {
        self.get_sandbox(caller, id).await?;
        self.stored_lifecycle(id).await
    }

    /// Whether traffic to sandbox `id` (an envd call, a guest port's
    /// connection) may wake it from hibernation: its policy's
    /// `auto_resume`. A front door that wakes a sandbox itself asks this
    /// first; exec and file calls ask it in the service.
    pub async fn may_auto_resume(&self, id: &SandboxId) -> ServiceResult<bool> {
        Ok(self.stored_lifecycle(id).await?.auto_resume)
    }

    /// Sandbox `id`'s idle timeout came (the scheduler, holding its
    /// operation lock): hibernate it, or delete it when its policy says
    /// `on_timeout: delete` (journaled as a delete, the reason in the
    /// event's detail). Returns what was done.
    pub(super) async fn idle_timeout_reached(
        self: &Arc<Self>,
        id: &SandboxId,
        g: OpGuard,
    ) -> ServiceResult<&'static str> {
        match self.stored_lifecycle(id).await?.on_timeout {
            OnTimeout::Hibernate => self
                .hibernate_locked(id, g, true)
                .await
                .map(|_| "hibernated"),
            OnTimeout::HibernateDisk => self
                .hibernate_locked(id, g, false)
                .await
                .map(|_| "hibernated (disk only)"),
            OnTimeout::Delete => self
                .delete_locked(
                    id,
                    g,
                    Some("idle timeout, on_timeout=delete (system)".into()),
                )
                .await
                .map(|_| "deleted"),
        }
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
        let g = self.acquire(id, Op::Delete, Who::User).await?;
        self.delete_locked(id, g, None).await
    }

    /// Deletes a sandbox under its operation lock; `detail` goes into the
    /// journal (why the daemon deleted it).
    pub(super) async fn delete_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        _g: OpGuard,
        detail: Option<String>,
    ) -> ServiceResult<SandboxRecord> {
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Delete)?;
        self.begin(&mut rec, Op::Delete, next, &[], detail.clone())
            .await?;
        if let Err(e) = self.engine.delete(id).await {
            self.failed(&mut rec, Op::Delete, &e.message(), &[]).await;
            return Err(e.into());
        }
        let id2 = id.clone();
        let mut snaps = self.db(move |s| s.list_snapshots(&id2, false)).await?;
        for s in &mut snaps {
            Self::dropped(s, "sandbox deleted".into());
        }
        let refs: Vec<&SnapshotRecord> = snaps.iter().collect();
        self.done(&mut rec, Op::Delete, next, None, &refs, detail)
            .await?;
        self.sched.remove(id);
        self.sampler.forget(id);
        self.logs.forget(id);
        self.forget_deleted(id);
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        for s in snaps {
            if let Err(e) = self.engine.delete_snapshot(&s.id).await {
                warn!(sandbox = %id, snapshot = %s.id, error = %e.message(), "removing snapshot failed; recovery will retry");
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
        let (_g, mut rec, next) = self.open_op(id, Op::Pause).await?;
        let r = self.engine.pause(id).await;
        self.close_op(&mut rec, Op::Pause, next, r.map(|()| None))
            .await?;
        Ok(rec)
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

    pub(super) async fn resume_ungated(
        self: &Arc<Self>,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
        let (_g, mut rec, next) = self.open_op(id, Op::Resume).await?;
        let result = if rec.state == SandboxState::Hibernated {
            let id2 = id.clone();
            match self.db(move |s| s.latest_ready_snapshot(&id2)).await? {
                Some(snap) => {
                    // A `same_as` record (e.g. a rewind's) wakes from the
                    // snapshot it names.
                    let snap = self.resolve_same_as(snap).await?;
                    let started = Instant::now();
                    let r = self.engine.wake(id, &snap.id).await;
                    if r.is_ok() {
                        self.metrics.observe_step(step::RESTORE, started.elapsed());
                    }
                    r.map(Some)
                }
                None => Err(RuntimeError::SnapshotNotFound(format!(
                    "(no snapshot to wake {id} from)"
                ))),
            }
        } else {
            self.engine.resume(id).await.map(|()| None)
        };
        if result.is_ok() {
            rec.last_activity_at = self.now();
        }
        let result = result.map(|vm| vm.map(|v: crate::engine::VmInfo| VmNow::pid(v.pid)));
        self.close_op(&mut rec, Op::Resume, next, result).await?;
        Ok(rec)
    }

    /// Hibernates a sandbox (snapshot, then the VM ends).
    pub async fn hibernate(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        self.hibernate_with(caller, id, opts, true).await
    }

    /// Hibernates a sandbox with its memory (as [`Service::hibernate`]) or,
    /// `memory: false`, of its disk alone (file systems synced and frozen
    /// first; the wake cold-boots it: same id, same envd token, a new boot).
    pub async fn hibernate_with(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
        memory: bool,
    ) -> ServiceResult<SandboxRecord> {
        self.authorize_on(caller, id, lifecycle("hibernate"), opts)
            .await?;
        let g = self.acquire(id, Op::Hibernate, Who::User).await?;
        self.hibernate_locked(id, g, memory).await
    }

    pub(crate) async fn hibernate_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        g: OpGuard,
        memory: bool,
    ) -> ServiceResult<SandboxRecord> {
        self.hibernate_because(id, g, memory, None).await
    }

    /// [`Service::hibernate_locked`], with why it was done (recorded in the
    /// journal's events of the hibernation, e.g. pressure).
    pub(crate) async fn hibernate_because(
        self: &Arc<Self>,
        id: &SandboxId,
        _g: OpGuard,
        memory: bool,
        why: Option<&str>,
    ) -> ServiceResult<SandboxRecord> {
        let detail = |snap: &SnapshotId| match why {
            Some(w) => format!("{snap} ({w})"),
            None => snap.to_string(),
        };
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Hibernate)?;
        let mut snap = self.new_snapshot(&rec, SnapshotKind::Hibernate, None);
        let stays = rec.state;
        self.begin(
            &mut rec,
            Op::Hibernate,
            stays,
            &[&snap],
            Some(detail(&snap.id)),
        )
        .await?;
        let started = Instant::now();
        let taken = if memory {
            self.engine.hibernate(id, &snap.id).await
        } else {
            self.engine.hibernate_disk(id, &snap.id).await
        };
        match taken {
            Ok(info) => {
                self.metrics
                    .observe_step(step::HIBERNATE, started.elapsed());
                self.observe_snapshot(started, &info);
                Self::ready(&mut snap, &info);
                self.done(
                    &mut rec,
                    Op::Hibernate,
                    next,
                    None,
                    &[&snap],
                    Some(detail(&snap.id)),
                )
                .await?;
                self.spawn_usage(snap.id.clone());
                self.replicate_later(id);
                Ok(rec)
            }
            Err(e) => {
                Self::dropped(&mut snap, format!("hibernate failed: {}", e.message()));
                self.failed(&mut rec, Op::Hibernate, &e.message(), &[&snap])
                    .await;
                Err(e.into())
            }
        }
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
        self.configure(&mut rec, format!("idle_timeout={}s", timeout_s.max(1)))
            .await?;
        self.reschedule(&rec);
        self.touch(id);
        Ok(rec)
    }

    /// Keeps `env` (environment variables for the sandbox's commands, e.g.
    /// the E2B door's `envVars`) with one of the caller's sandboxes; empty:
    /// none. They survive a daemon restart, go when the sandbox is deleted,
    /// and no API returns them. Stored sealed by the key store
    /// (`security::keys`, bound to the sandbox id); without a usable key
    /// store nothing is stored (`ServiceError::Keys`).
    pub async fn set_sandbox_env(
        &self,
        caller: &Caller,
        id: &SandboxId,
        env: BTreeMap<String, String>,
    ) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        let sealed = if env.is_empty() {
            None
        } else {
            Some(self.seal_env(id, &env)?)
        };
        let id = id.clone();
        self.db(move |s| s.put_sandbox_env(&id, sealed.as_deref()))
            .await
    }

    /// The environment kept with every sandbox not deleted, read at once
    /// (blocking: for a front door's start, before it serves). A row from
    /// before sealing (plain JSON, store schema 7) is sealed in place; a
    /// row that does not open (changed, moved to another sandbox, another
    /// deployment's key) is left out with an error in the log.
    pub fn stored_envs(&self) -> ServiceResult<Vec<(SandboxId, BTreeMap<String, String>)>> {
        let mut out = Vec::new();
        for (id, stored) in self.store.sandbox_envs()? {
            if !crate::security::keys::is_sealed(&stored) {
                let env: BTreeMap<String, String> = match serde_json::from_str(&stored) {
                    Ok(env) => env,
                    Err(e) => {
                        tracing::error!(sandbox = %id, error = %e, "stored environment is not JSON: left out");
                        continue;
                    }
                };
                let sealed = self.seal_env(&id, &env)?;
                self.store.put_sandbox_env(&id, Some(&sealed))?;
                out.push((id, env));
                continue;
            }
            let opened = self
                .env_sealer()
                .and_then(|s| {
                    s.open(id.as_str(), &stored)
                        .map_err(|e| ServiceError::Keys(e.to_string()))
                })
                .and_then(|plain| {
                    serde_json::from_slice(&plain)
                        .map_err(|e| ServiceError::Keys(format!("sealed environment: {e}")))
                });
            match opened {
                Ok(env) => out.push((id, env)),
                Err(e) => {
                    tracing::error!(sandbox = %id, error = %e, "stored environment does not open: left out")
                }
            }
        }
        Ok(out)
    }

    /// Keeps a front door's setting `key` (≤ 64 bytes) with one of the
    /// caller's sandboxes (`None`: removes it): JSON of at most 4 KiB, kept
    /// until the sandbox is deleted, read back at the door's start with
    /// [`Service::stored_settings`]. Not returned by any API of its own.
    pub async fn set_sandbox_setting(
        &self,
        caller: &Caller,
        id: &SandboxId,
        key: &str,
        value: Option<&serde_json::Value>,
    ) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        if key.is_empty() || key.len() > 64 {
            return Err(ServiceError::InvalidRequest(
                "setting key: 1 to 64 bytes".into(),
            ));
        }
        let text = value.map(|v| v.to_string());
        if text.as_ref().is_some_and(|t| t.len() > 4096) {
            return Err(ServiceError::InvalidRequest(
                "setting value: at most 4096 bytes of JSON".into(),
            ));
        }
        let (id, key) = (id.clone(), key.to_owned());
        self.db(move |s| s.put_sandbox_setting(&id, &key, text.as_deref()))
            .await
    }

    /// Keeps a front door's setting `key` (1–200 bytes) of the caller's
    /// tenant (`None`: removes it): JSON of at most 64 KiB, read back at the
    /// door's start with [`Service::stored_tenant_settings`].
    pub async fn set_tenant_setting(
        &self,
        caller: &Caller,
        key: &str,
        value: Option<&serde_json::Value>,
    ) -> ServiceResult<()> {
        if key.is_empty() || key.len() > 200 {
            return Err(ServiceError::InvalidRequest(
                "setting key: 1 to 200 bytes".into(),
            ));
        }
        let text = value.map(|v| v.to_string());
        if text.as_ref().is_some_and(|t| t.len() > 64 * 1024) {
            return Err(ServiceError::InvalidRequest(
                "setting value: at most 64 KiB of JSON".into(),
            ));
        }
        let (tenant, key) = (caller.owner().to_owned(), key.to_owned());
        self.db(move |s| s.put_tenant_setting(&tenant, &key, text.as_deref()))
            .await
    }

    /// Every tenant's settings whose key starts with `prefix` (blocking:
    /// for a front door's start): (tenant, key, value); a value that is not
    /// JSON is left out with an error in the log.
    pub fn stored_tenant_settings(
        &self,
        prefix: &str,
    ) -> ServiceResult<Vec<(String, String, serde_json::Value)>> {
        let mut out = Vec::new();
        for (tenant, key, text) in self.store.tenant_settings(prefix)? {
            match serde_json::from_str(&text) {
                Ok(v) => out.push((tenant, key, v)),
                Err(e) => {
                    tracing::error!(tenant, key, error = %e, "stored tenant setting is not JSON: left out")
                }
            }
        }
        Ok(out)
    }

    /// Setting `key` of every sandbox not deleted that has one (blocking:
    /// for a front door's start); a value that is not JSON is left out with
    /// an error in the log.
    pub fn stored_settings(&self, key: &str) -> ServiceResult<Vec<(SandboxId, serde_json::Value)>> {
        let mut out = Vec::new();
        for (id, text) in self.store.sandbox_settings(key)? {
            match serde_json::from_str(&text) {
                Ok(v) => out.push((id, v)),
                Err(e) => {
                    tracing::error!(sandbox = %id, key, error = %e, "stored setting is not JSON: left out")
                }
            }
        }
        Ok(out)
    }

    fn seal_env(&self, id: &SandboxId, env: &BTreeMap<String, String>) -> ServiceResult<String> {
        let json =
            serde_json::to_vec(env).map_err(|e| ServiceError::Keys(format!("environment: {e}")))?;
        self.env_sealer()?
            .seal(id.as_str(), &json)
            .map_err(|e| ServiceError::Keys(e.to_string()))
    }

    fn env_sealer(&self) -> ServiceResult<crate::security::keys::Sealer> {
        self.sealer(crate::security::keys::Purpose::SandboxEnv)
    }

    /// The key store's sealer for `purpose` (the key store opened on
    /// first use; without it nothing is sealed: `ServiceError::Keys`).
    pub(crate) fn sealer(
        &self,
        purpose: crate::security::keys::Purpose,
    ) -> ServiceResult<crate::security::keys::Sealer> {
        use crate::security::keys::KeyStore;
        let store = self
            .keys
            .get_or_init(|| {
                KeyStore::open(&self.config.key_dir)
                    .map(Arc::new)
                    .map_err(|e| {
                        tracing::error!(error = %e, "key store unavailable");
                        e.to_string()
                    })
            })
            .as_ref()
            .map_err(|e| ServiceError::Keys(e.clone()))?;
        store
            .sealer(purpose)
            .map_err(|e| ServiceError::Keys(e.to_string()))
    }

    /// Records activity on one of the caller's sandboxes (postpones idle
    /// hibernation).
    pub async fn refresh(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        self.touch(id);
        Ok(())
    }
}
