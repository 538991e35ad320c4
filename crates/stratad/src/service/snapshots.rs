//! Manual and rolling snapshots, their records, retention (GC).

use super::prelude::*;

impl Service {
    pub(super) fn new_snapshot(
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

    pub(super) fn ready(snap: &mut SnapshotRecord, info: &crate::engine::SnapshotInfo) {
        snap.status = SnapshotStatus::Ready;
        snap.created_at = info.created_at;
        snap.pause_ms = Some(info.pause_ms);
    }

    pub(super) fn dropped(snap: &mut SnapshotRecord, why: String) {
        snap.status = SnapshotStatus::Deleted;
        snap.status_reason = Some(why);
    }

    pub(super) fn observe_snapshot(&self, started: Instant, info: &crate::engine::SnapshotInfo) {
        self.metrics.observe_step(step::SNAPSHOT, started.elapsed());
        self.metrics.observe_step(
            step::SNAPSHOT_PAUSE,
            Duration::from_secs_f64(info.pause_ms.max(0.0) / 1000.0),
        );
    }

    pub(super) fn spawn_usage(self: &Arc<Self>, snap: SnapshotId) {
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

    pub(super) async fn snapshot_locked(
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
                Self::dropped(&mut snap, format!("snapshot failed: {}", e.message()));
                self.metrics.count("snapshot_failed");
                (EventPhase::Failed, format!("{}: {}", snap.id, e.message()))
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
            warn!(snapshot = %id, error = %e.message(), "removing snapshot failed; recovery will retry");
        }
        Ok(snap)
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
                warn!(sandbox = %id, snapshot = %r.id, error = %e.message(), "GC removal failed; recovery will retry");
            }
        }
        Ok(recs.len())
    }
}
