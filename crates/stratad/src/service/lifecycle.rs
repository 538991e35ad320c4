//! Create, delete, pause, resume (wake), hibernate; sandbox settings.

use super::prelude::*;

impl Service {
    /// Creates a sandbox from a template. vCPUs and memory are the template's
    /// (a snapshot restores with the RAM and CPUs it was taken with); the
    /// disk may be larger than the template's (it grows).
    pub async fn create(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: CreateSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let (tpl, rec) = self.admit_create(caller, &cmd, opts).await?;
        self.spawn_new(rec, Source::Template(tpl.id), step::SPAWN)
            .await
    }

    /// The checks every create makes, in order: the size, the template is
    /// one the caller may use (else `not_found`, as for an unknown id), the
    /// gate (`lifecycle create`), then the template is ready (waiting for a
    /// build in progress); then the new record, of the template's size.
    pub(super) async fn admit_create(
        &self,
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
        let tpl = self.resolve_template(caller, cmd.template.as_ref()).await?;
        let size = cmd.spec.size.over(tpl.size);
        size.validate()?;
        check_source_size(&format!("template {}", tpl.id), tpl.size, size)?;
        let mut rec = self.new_record(caller.owner(), &cmd.spec, size)?;
        rec.template = Some(tpl.id.clone());
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

    /// Makes sure a sandbox runs, waking it from hibernation (wake-on-access).
    pub(super) async fn ensure_awake(
        self: &Arc<Self>,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
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
        self.begin(&mut rec, Op::Delete, next, &[], None).await?;
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
        self.done(&mut rec, Op::Delete, next, None, &refs, None)
            .await?;
        self.sched.remove(id);
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
        self.authorize_on(caller, id, lifecycle("hibernate"), opts)
            .await?;
        let g = self.acquire(id, Op::Hibernate, Who::User).await?;
        self.hibernate_locked(id, g).await
    }

    pub(super) async fn hibernate_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        _g: OpGuard,
    ) -> ServiceResult<SandboxRecord> {
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Hibernate)?;
        let mut snap = self.new_snapshot(&rec, SnapshotKind::Hibernate, None);
        let stays = rec.state;
        self.begin(
            &mut rec,
            Op::Hibernate,
            stays,
            &[&snap],
            Some(snap.id.to_string()),
        )
        .await?;
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
                    None,
                    &[&snap],
                    Some(snap.id.to_string()),
                )
                .await?;
                self.spawn_usage(snap.id.clone());
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
    /// and no API returns them. Stored as JSON (no key store to encrypt
    /// with; the database file is mode 0600).
    pub async fn set_sandbox_env(
        &self,
        caller: &Caller,
        id: &SandboxId,
        env: BTreeMap<String, String>,
    ) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        let id = id.clone();
        self.db(move |s| s.put_sandbox_env(&id, &env)).await
    }

    /// The environment kept with every sandbox not deleted, read at once
    /// (blocking: for a front door's start, before it serves).
    pub fn stored_envs(&self) -> ServiceResult<Vec<(SandboxId, BTreeMap<String, String>)>> {
        Ok(self.store.sandbox_envs()?)
    }

    /// Records activity on one of the caller's sandboxes (postpones idle
    /// hibernation).
    pub async fn refresh(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<()> {
        self.get_sandbox(caller, id).await?;
        self.touch(id);
        Ok(())
    }
}
