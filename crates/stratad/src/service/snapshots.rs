//! Manual and rolling snapshots, their records, retention (GC), and the
//! pool-bytes quotas on them (see `service::admission` for the charge):
//! - a manual snapshot is refused with `quota_exceeded` before anything is
//!   written when its tenant (or sandbox) already holds its quota, and
//!   removed again (never listed) when the bytes it would add go over;
//! - a rolling snapshot of a sandbox at its quota is skipped; the first skip
//!   in a row is journaled (`snapshot`, `failed`, "rolling snapshot skipped:
//!   …" in `GET /v1/sandboxes/{id}/events`), later ones only counted in the
//!   metrics, so an over-quota sandbox does not grow the journal each tick;
//! - hibernation and pre-rewind snapshots are never refused (they keep the
//!   sandbox's state), only charged;
//! - a hibernated sandbox's wake snapshot (its latest ready one) is never
//!   deleted: not by retention, and a user's delete is `invalid_state`.

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
            charge_bytes: None,
            same_as: None,
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
            if this.config.quotas.limits_pool_bytes() {
                // Charge it now, so the next quota check finds it cached.
                let id = snap.clone();
                if let Ok(Some(r)) = this.db(move |s| s.get_snapshot(&id)).await {
                    if r.status == SnapshotStatus::Ready && r.charge_bytes.is_none() {
                        if let Err(e) = this.charge_ready_snapshot(&r).await {
                            warn!(snapshot = %snap, error = %e.message(), "charging a snapshot failed");
                        }
                    }
                }
            }
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
        self.ensure_awake_explicit(id).await?;
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
        // A rolling snapshot of a guest where nothing happened is recorded,
        // not taken (`service::unchanged`); a manual one is always taken.
        if kind == SnapshotKind::Rolling && self.config.snapshots.skip_unchanged {
            match self.unchanged_since(id).await {
                Ok(same) => {
                    if let Some(r) = self.record_same_as(&rec, same).await? {
                        return Ok(r);
                    }
                }
                Err(why) => {
                    tracing::debug!(sandbox = %id, reason = %why, "guest changed: rolling snapshot taken")
                }
            }
        }
        let quota = self.config.quotas.limits_pool_bytes()
            && matches!(kind, SnapshotKind::Manual | SnapshotKind::Rolling);
        if quota {
            if let Err(e) = self.check_pool_quota(&rec, 0, true).await {
                if kind == SnapshotKind::Rolling {
                    self.record_rolling_skip(&rec, &e).await;
                }
                return Err(e);
            }
        }
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
        let before = self.before_snapshot(id).await;
        let started = Instant::now();
        // The record said running: an engine that no longer runs the VM
        // lost it under the snapshot (killed, crashed), not a wrong state.
        let mut result = self
            .engine
            .snapshot(id, &snap.id)
            .await
            .map_err(|e| match e {
                RuntimeError::NotRunning { id } => RuntimeError::VmFailed {
                    id,
                    reason: "the VM ended during the snapshot".into(),
                },
                e => e,
            });
        let mut refused = None;
        if quota && kind == SnapshotKind::Manual && result.is_ok() {
            // What it adds, against what the tenant holds without it.
            let verdict = match self.charge_new_snapshot(&rec, &snap).await {
                Ok(extra) => {
                    snap.charge_bytes = Some(extra);
                    self.check_pool_quota(&rec, extra, false).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = verdict {
                if let Err(d) = self.engine.delete_snapshot(&snap.id).await {
                    warn!(snapshot = %snap.id, error = %d.message(), "removing a refused snapshot failed; recovery will retry");
                }
                result = Err(RuntimeError::Other(e.message()));
                refused = Some(e);
            }
        }
        let (phase, detail) = match &result {
            Ok(info) => {
                self.observe_snapshot(started, info);
                Self::ready(&mut snap, info);
                self.after_snapshot(id, &snap.id, before);
                (EventPhase::Done, snap.id.to_string())
            }
            Err(_) if refused.is_some() => {
                let why = refused.as_ref().map(|e| e.message()).unwrap_or_default();
                Self::dropped(&mut snap, format!("quota_exceeded: {why}"));
                self.metrics.count("snapshot_quota_refused");
                (
                    EventPhase::Failed,
                    format!("{}: quota_exceeded: {why}", snap.id),
                )
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
        if let Some(e) = refused {
            return Err(e);
        }
        match result {
            Ok(_) => {
                self.spawn_usage(snap.id.clone());
                self.replicate_later(id);
                Ok(snap)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Records the rolling snapshot of an unchanged guest as `same_as` its
    /// previous real snapshot: ready at once, no pause, no subvolume, 0
    /// bytes; the journal says why.
    async fn record_same_as(
        &self,
        rec: &SandboxRecord,
        same: super::unchanged::Same,
    ) -> ServiceResult<Option<SnapshotRecord>> {
        let t = same.target.clone();
        let Some(target) = self
            .db(move |s| s.get_snapshot(&t))
            .await?
            .filter(|t| t.status == SnapshotStatus::Ready && t.same_as.is_none())
        else {
            // Gone meanwhile (a user's delete): take a real one.
            return Ok(None);
        };
        let mut snap = self.new_snapshot(rec, SnapshotKind::Rolling, None);
        snap.status = SnapshotStatus::Ready;
        snap.same_as = Some(target.id.clone());
        snap.exclusive_bytes = Some(0);
        snap.referenced_bytes = target.referenced_bytes;
        let s = snap.clone();
        let ev = Event::new(
            rec,
            Op::Snapshot,
            Some(rec.state),
            EventPhase::Done,
            Some(format!(
                "{}: rolling snapshot skipped, same_as {}: {}",
                snap.id, target.id, same.why
            )),
            self.now(),
        );
        self.db(move |st| st.commit(&[], &[&s], Some(&ev))).await?;
        self.metrics.count(super::unchanged::SKIPPED_METRIC);
        info!(sandbox = %rec.id, snapshot = %snap.id, same_as = %target.id, "guest unchanged: rolling snapshot recorded, not taken");
        Ok(Some(snap))
    }

    /// Journals why a rolling snapshot was skipped, once per run of skips
    /// (the journal is append-only: one entry per tick would grow it for
    /// as long as the sandbox stays over its quota).
    async fn record_rolling_skip(&self, rec: &SandboxRecord, why: &ServiceError) {
        self.metrics.count("snapshot_quota_skipped");
        let detail = format!(
            "rolling snapshot skipped: {}: {}",
            why.code().as_str(),
            why.message()
        );
        let id = rec.id.clone();
        let last = self.db(move |s| s.events(&id, 1)).await.unwrap_or_default();
        let again = last.last().is_some_and(|e| {
            e.op == Op::Snapshot
                && e.phase == EventPhase::Failed
                && e.detail
                    .as_deref()
                    .is_some_and(|d| d.starts_with("rolling snapshot skipped"))
        });
        warn!(sandbox = %rec.id, reason = %detail, "rolling snapshot skipped");
        if again {
            return;
        }
        let ev = Event::new(
            rec,
            Op::Snapshot,
            Some(rec.state),
            EventPhase::Failed,
            Some(detail),
            self.now(),
        );
        if let Err(e) = self.db(move |st| st.commit(&[], &[], Some(&ev))).await {
            warn!(sandbox = %rec.id, error = %e.message(), "journaling a skipped rolling snapshot failed");
        }
    }

    /// The snapshot a hibernated sandbox wakes from (its latest ready one),
    /// if `sandbox` is hibernated.
    async fn wake_snapshot(&self, sandbox: &SandboxId) -> ServiceResult<Option<SnapshotId>> {
        let id = sandbox.clone();
        self.db(move |s| {
            Ok(match s.get_sandbox(&id)? {
                Some(r) if r.state == SandboxState::Hibernated => {
                    s.latest_ready_snapshot(&id)?.map(|x| x.id)
                }
                _ => None,
            })
        })
        .await
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

    /// The ready snapshots of the caller's tenant (every sandbox's, deleted
    /// sandboxes' included), oldest first.
    pub async fn tenant_snapshots(&self, caller: &Caller) -> ServiceResult<Vec<SnapshotRecord>> {
        let tenant = caller.owner().to_owned();
        let mut v = self.db(move |s| s.tenant_ready_snapshots(&tenant)).await?;
        v.retain(|r| caller.sees(&r.tenant));
        v.sort_by(|a, b| (a.created_at, a.id.as_str()).cmp(&(b.created_at, b.id.as_str())));
        Ok(v)
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
        // The `same_as` records of this snapshot go with it: none may name
        // a snapshot that is gone.
        let mut same = if snap.same_as.is_none() {
            let (sb, target) = (snap.sandbox_id.clone(), id.clone());
            self.db(move |s| s.list_snapshots(&sb, false))
                .await?
                .into_iter()
                .filter(|r| {
                    r.status == SnapshotStatus::Ready && r.same_as.as_ref() == Some(&target)
                })
                .collect()
        } else {
            Vec::new()
        };
        let wake = self.wake_snapshot(&snap.sandbox_id).await?;
        if wake.as_ref() == Some(id) || same.iter().any(|r| Some(&r.id) == wake.as_ref()) {
            return Err(ServiceError::InvalidStateOther(format!(
                "snapshot {id} is what hibernated sandbox {} wakes from; wake or delete the sandbox first",
                snap.sandbox_id
            )));
        }
        Self::dropped(&mut snap, "deleted by user".into());
        for r in &mut same {
            Self::dropped(r, format!("deleted with {id}, which it was the same as"));
        }
        let mut all = vec![snap.clone()];
        all.append(&mut same);
        self.db(move |st| {
            let refs: Vec<&SnapshotRecord> = all.iter().collect();
            st.commit(&[], &refs, None)
        })
        .await?;
        // A `same_as` record has no subvolume of its own.
        if snap.same_as.is_none() {
            if let Err(e) = self.engine.delete_snapshot(id).await {
                warn!(snapshot = %id, error = %e.message(), "removing snapshot failed; recovery will retry");
            }
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
        // The restore point (and a hibernated sandbox's wake snapshot) is
        // the newest ready snapshot as the store orders them; kept whatever
        // retention would say (also when two share a timestamp).
        let id3 = id.clone();
        let keep: Vec<SnapshotId> = self
            .db(move |s| s.latest_ready_snapshot(&id3))
            .await?
            .map(|s| s.id)
            .into_iter()
            .collect();
        let mut doomed = self
            .config
            .retention
            .to_delete_keeping(&points, self.now(), &keep);
        // A snapshot a kept `same_as` record names stays (the record is
        // its stand-in).
        let aliases: Vec<(SnapshotId, SnapshotId)> = snaps
            .iter()
            .filter(|s| s.status == SnapshotStatus::Ready)
            .filter_map(|s| Some((s.id.clone(), s.same_as.clone()?)))
            .collect();
        crate::retention::spare_targets(&mut doomed, &aliases);
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
        for r in recs.iter().filter(|r| r.same_as.is_none()) {
            if let Err(e) = self.engine.delete_snapshot(&r.id).await {
                warn!(sandbox = %id, snapshot = %r.id, error = %e.message(), "GC removal failed; recovery will retry");
            }
        }
        Ok(recs.len())
    }
}
