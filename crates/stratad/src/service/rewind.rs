//! Rewind: a sandbox returned to one of its own snapshots, in place.

use super::prelude::*;

impl Service {
    /// The `rewind` record of a rewind to `target` (`real`: what it
    /// restores, `same_as` resolved): ready at once, no subvolume, and newer
    /// than the `pre_rewind` snapshot, so the sandbox's restore point (its
    /// newest ready snapshot, for crash recovery and wake) is the state the
    /// rewind made, not the one it left. Found by the chaos harness: a QEMU
    /// killed after a rewind was restored from the pre-rewind state,
    /// undoing an acknowledged rewind.
    fn rewind_mark(
        &self,
        rec: &SandboxRecord,
        target: &SnapshotRecord,
        real: &SnapshotRecord,
        pre: Option<&SnapshotRecord>,
    ) -> SnapshotRecord {
        let mut mark = self.new_snapshot(
            rec,
            SnapshotKind::Rewind,
            Some(format!("rewound to {}", target.id)),
        );
        mark.status = SnapshotStatus::Ready;
        mark.same_as = Some(real.id.clone());
        mark.exclusive_bytes = Some(0);
        mark.referenced_bytes = real.referenced_bytes;
        mark.charge_bytes = Some(0);
        // The engine stamps the pre-rewind snapshot with its own clock:
        // strictly after it, whatever this service's clock says.
        if let Some(p) = pre.filter(|p| p.status == SnapshotStatus::Ready) {
            let after = p.created_at + chrono::Duration::milliseconds(1);
            if mark.created_at < after {
                mark.created_at = after;
            }
        }
        mark
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
                // Checked: "100000000000d" is before any date chrono holds.
                let at = chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| self.now().checked_sub_signed(d))
                    .ok_or_else(|| {
                        ServiceError::InvalidRequest(format!("ago {ago:?}: too far back"))
                    })?;
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
        // A `same_as` record (a minute where nothing changed) restores the
        // snapshot it names; the answer still names the record asked for.
        let real = self.resolve_same_as(target.clone()).await?;
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
        let room = if super::admission::starts_vm(rec.state, Op::Rewind) {
            Some(self.admit(&rec).await?)
        } else {
            None
        };
        let pending: Vec<&SnapshotRecord> = pre.iter().collect();
        self.begin(
            &mut rec,
            Op::Rewind,
            next,
            &pending,
            Some(target.id.to_string()),
        )
        .await?;
        drop(room);
        let started = Instant::now();
        let result = self
            .engine
            .rewind(id, &real.id, pre.as_ref().map(|p| &p.id))
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
                rec.last_activity_at = self.now();
                let mark = self.rewind_mark(&rec, &target, &real, pre.as_ref());
                let snaps: Vec<&SnapshotRecord> = pre.iter().chain([&mark]).collect();
                self.done(
                    &mut rec,
                    Op::Rewind,
                    next,
                    Some(VmNow::pid(vm.pid)),
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
                    Self::dropped(p, format!("rewind failed: {}", e.message()));
                }
                let snaps: Vec<&SnapshotRecord> = pre.iter().collect();
                self.failed(&mut rec, Op::Rewind, &e.message(), &snaps)
                    .await;
                // The engine ends the VM before it starts the target's: a
                // rewind that failed after that leaves none behind the record.
                self.settle_lost_vm(&mut rec, Op::Rewind, &e.message())
                    .await;
                Err(e.into())
            }
        }
    }
}
