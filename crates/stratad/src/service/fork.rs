//! Forks of a live sandbox or of a snapshot.

use super::prelude::*;

impl Service {
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
        if src_rec.state.fork_source()? == strata_core::ForkSource::LatestSnapshot {
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
        self.inherit_layer(&rec, src).await?;
        let (asked, replicate) = (spec.lifecycle, spec.replicate);
        rec.template = src_rec.template.clone();
        let mut snap = self.new_snapshot(&src_rec, SnapshotKind::Fork, None);
        rec.source_snapshot = Some(snap.id.clone());
        let span = tracing::info_span!("fork", sandbox = %rec.id, source = %src);
        let _busy = self.warm.busy();
        async move {
            {
                let _room = self.admit(&rec).await?;
                let detail = format!("fork of {src} via {}", snap.id);
                self.begin_create(&mut rec, Some(&snap), Some(detail))
                    .await?;
            }
            let started = Instant::now();
            match self.engine.fork_live(src, &snap.id, &rec.id, size).await {
                Ok((info, vm)) => {
                    self.metrics.observe_step(step::RESTORE, started.elapsed());
                    self.observe_snapshot(started, &info);
                    Self::ready(&mut snap, &info);
                    self.done(
                        &mut rec,
                        Op::Created,
                        SandboxState::Running,
                        Some(VmNow::of(&vm)),
                        &[&snap],
                        None,
                    )
                    .await?;
                    self.spawn_usage(snap.id.clone());
                    self.keep_lifecycle(&rec, asked, Some(src)).await;
                    self.keep_replicate(&rec, replicate).await;
                    Ok(rec)
                }
                Err(e) => {
                    let why = e.message();
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, Some(snap), format!("fork failed: {why}"), &why)
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

    pub(super) async fn fork_snapshot_ungated(
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
        // A `same_as` record forks the snapshot it names (the fork's
        // source is that real snapshot).
        let s = self.resolve_same_as(s).await?;
        let snap = &s.id;
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
        self.inherit_layer(&rec, &s.sandbox_id).await?;
        rec.template = src.and_then(|r| r.template);
        rec.source_snapshot = Some(snap.clone());
        let rec = self
            .spawn_new(rec, Source::Snapshot(snap.clone()), step::RESTORE)
            .await?;
        self.keep_lifecycle(&rec, spec.lifecycle, Some(&s.sandbox_id))
            .await;
        self.keep_replicate(&rec, spec.replicate).await;
        Ok(rec)
    }

    /// The fork `rec` gets the policy layer of sandbox `src` before it runs;
    /// a layer that cannot be copied stops the fork (fail closed).
    async fn inherit_layer(&self, rec: &SandboxRecord, src: &SandboxId) -> ServiceResult<()> {
        self.gate
            .inherit_layer(&rec.tenant, src.as_str(), rec.id.as_str())
            .await
            .map_err(|why| {
                ServiceError::Gate(GateRefusal::Internal(format!(
                    "fork of {src}: its policy layer: {why}"
                )))
            })
    }
}
