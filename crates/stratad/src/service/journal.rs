//! The transition writer: the only code that writes a sandbox's `state`,
//! `pending_op`, `state_reason`, `pid` and the journal event of a
//! transition, each write a compare-and-set on the record's version.

use super::prelude::*;

/// What the engine reported about the VM a transition leaves running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VmNow {
    /// Its process id.
    pub(crate) pid: u32,
    /// Its accelerator, when it changed (a new VM).
    pub(crate) accel: Option<String>,
}

impl VmNow {
    pub(crate) fn of(vm: &crate::engine::VmInfo) -> Self {
        VmNow {
            pid: vm.pid,
            accel: Some(vm.accel.clone()),
        }
    }

    pub(crate) fn pid(pid: u32) -> Self {
        VmNow { pid, accel: None }
    }
}

impl Service {
    /// The one write of a sandbox record with its journal event (and the
    /// snapshot rows of the same step), in one transaction. An update is a
    /// compare-and-set on `rec.version`: a writer holding an older copy gets
    /// `StoreError::Stale` and changes nothing; on success `rec.version`
    /// moves on with the stored one.
    async fn write(
        &self,
        rec: &mut SandboxRecord,
        ev: Option<Event>,
        snaps: &[&SnapshotRecord],
        insert: bool,
    ) -> ServiceResult<()> {
        let (r, s): (SandboxRecord, Vec<SnapshotRecord>) =
            (rec.clone(), snaps.iter().map(|s| (*s).clone()).collect());
        self.db(move |st| {
            let refs: Vec<&SnapshotRecord> = s.iter().collect();
            if insert {
                let ev =
                    ev.ok_or_else(|| StoreError::Task("a new sandbox needs its event".into()))?;
                st.insert_sandbox(&r, &ev)?;
                refs.iter().try_for_each(|sn| st.put_snapshot(sn))
            } else {
                st.commit(&[&r], &refs, ev.as_ref())
            }
        })
        .await?;
        if !insert {
            rec.version += 1;
        }
        Ok(())
    }

    /// Lands `rec` in `next` (the one place a state is assigned): no op
    /// pending, the VM the engine reported (a state without a VM has no
    /// pid), the deletion time. Returns the state it left.
    fn land(&self, rec: &mut SandboxRecord, next: SandboxState, vm: Option<VmNow>) -> SandboxState {
        let from = rec.state;
        rec.state = next;
        rec.pending_op = None;
        rec.updated_at = self.now();
        if let Some(vm) = vm {
            rec.pid = Some(vm.pid);
            if vm.accel.is_some() {
                rec.accel = vm.accel;
            }
        }
        if !next.has_vm() {
            rec.pid = None;
        }
        if next == SandboxState::Deleted && rec.deleted_at.is_none() {
            rec.deleted_at = Some(self.now());
        }
        from
    }

    fn event(
        &self,
        rec: &SandboxRecord,
        op: Op,
        from: Option<SandboxState>,
        to: Option<SandboxState>,
        phase: EventPhase,
        detail: Option<String>,
    ) -> Event {
        let mut ev = Event::new(rec, op, to, phase, detail, self.now());
        ev.from_state = from;
        ev
    }

    /// Step 3 of an operation: `op` is recorded as pending (with the
    /// snapshot rows it makes, `pending`) before the engine acts. `to` is
    /// the state it leads to, for the journal.
    pub(crate) async fn begin(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        to: SandboxState,
        snaps: &[&SnapshotRecord],
        detail: Option<String>,
    ) -> ServiceResult<()> {
        rec.pending_op = Some(op);
        rec.updated_at = self.now();
        let ev = self.event(
            rec,
            op,
            Some(rec.state),
            Some(to),
            EventPhase::Pending,
            detail,
        );
        self.write(rec, Some(ev), snaps, false).await
    }

    /// Step 4, success: the new state is acknowledged (with the VM the
    /// engine left running, and the snapshot rows the step made ready).
    pub(crate) async fn done(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        next: SandboxState,
        vm: Option<VmNow>,
        snaps: &[&SnapshotRecord],
        detail: Option<String>,
    ) -> ServiceResult<()> {
        rec.state_reason = None;
        let from = self.land(rec, next, vm);
        let ev = self.event(rec, op, Some(from), Some(next), EventPhase::Done, detail);
        self.write(rec, Some(ev), snaps, false).await?;
        self.reschedule(rec);
        Ok(())
    }

    /// Steps 1–3 of a user operation on one sandbox: its lock, its record
    /// (counted as activity), the state machine's answer, the pending write.
    pub(crate) async fn open_op(
        &self,
        id: &SandboxId,
        op: Op,
    ) -> ServiceResult<(OpGuard, SandboxRecord, SandboxState)> {
        let g = self.acquire(id, op, Who::User).await?;
        let mut rec = self.record(id).await?;
        self.touch(id);
        let next = rec.state.apply(op)?;
        // Room first when the operation starts a VM (a wake): the pending
        // write is the reservation, made under the placement lock.
        let room = if admission::starts_vm(rec.state, op) {
            Some(self.admit(&rec).await?)
        } else {
            None
        };
        self.begin(&mut rec, op, next, &[], None).await?;
        drop(room);
        Ok((g, rec, next))
    }

    /// Step 4 of what [`Service::open_op`] opened, from the engine's answer.
    pub(crate) async fn close_op(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        next: SandboxState,
        result: Result<Option<VmNow>, RuntimeError>,
    ) -> ServiceResult<()> {
        match result {
            Ok(vm) => self.done(rec, op, next, vm, &[], None).await,
            Err(e) => {
                self.failed(rec, op, &e.message(), &[]).await;
                Err(e.into())
            }
        }
    }

    /// Step 4, failure: the previous state stays, the reason is kept (best
    /// effort: the failure is the answer; recovery settles a pending op).
    pub(crate) async fn failed(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        err: &(dyn std::fmt::Display + Sync),
        snaps: &[&SnapshotRecord],
    ) {
        rec.pending_op = None;
        rec.state_reason = Some(format!("{op} failed: {err}"));
        rec.updated_at = self.now();
        let ev = self.event(
            rec,
            op,
            Some(rec.state),
            Some(rec.state),
            EventPhase::Failed,
            Some(err.to_string()),
        );
        if let Err(e) = self.write(rec, Some(ev), snaps, false).await {
            warn!(sandbox = %rec.id, error = %e.message(), "recording a failed {op} failed");
        }
        self.metrics.count("operation_failed");
    }

    /// A state change that is not an engine operation of the daemon's: the
    /// VM died (`Fail`), recovery settled what a restart interrupted. The
    /// reason is recorded with the state.
    pub(crate) async fn settle(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        next: SandboxState,
        reason: Option<String>,
        detail: Option<String>,
    ) -> ServiceResult<()> {
        rec.state_reason = reason;
        let from = self.land(rec, next, None);
        let phase = if next == from && rec.state_reason.is_some() {
            EventPhase::Failed
        } else {
            EventPhase::Done
        };
        let ev = self.event(rec, op, Some(from), Some(next), phase, detail);
        self.write(rec, Some(ev), &[], false).await
    }

    /// Start-up reconciliation settled a record (`EventPhase::Recovered`):
    /// a pending op completed or rolled back, a VM adopted (its new pid) or
    /// found gone (with the reason).
    pub(crate) async fn recovered(
        &self,
        rec: &mut SandboxRecord,
        op: Op,
        next: SandboxState,
        vm: Option<VmNow>,
        reason: Option<String>,
        detail: String,
    ) -> ServiceResult<()> {
        if let Some(r) = reason {
            rec.state_reason = Some(r);
        }
        let from = self.land(rec, next, vm);
        let ev = self.event(
            rec,
            op,
            Some(from),
            Some(next),
            EventPhase::Recovered,
            Some(detail),
        );
        self.write(rec, Some(ev), &[], false).await
    }

    /// A change of settings (idle timeout): no state change, journaled.
    pub(crate) async fn configure(
        &self,
        rec: &mut SandboxRecord,
        detail: String,
    ) -> ServiceResult<()> {
        rec.updated_at = self.now();
        let ev = self.event(
            rec,
            Op::Configure,
            Some(rec.state),
            Some(rec.state),
            EventPhase::Done,
            Some(detail),
        );
        self.write(rec, Some(ev), &[], false).await
    }

    /// A new sandbox recorded as creating (with the snapshot made for it,
    /// pending) in one transaction before the engine acts: a crash before
    /// the end is rolled back by recovery (sandbox deleted, snapshot removed).
    pub(crate) async fn begin_create(
        &self,
        rec: &mut SandboxRecord,
        snap: Option<&SnapshotRecord>,
        detail: Option<String>,
    ) -> ServiceResult<()> {
        self.land(rec, SandboxState::Creating, None);
        rec.pending_op = Some(Op::Created);
        let ev = self.event(
            rec,
            Op::Created,
            Some(SandboxState::Creating),
            None,
            EventPhase::Pending,
            detail,
        );
        let snaps: Vec<&SnapshotRecord> = snap.into_iter().collect();
        self.write(rec, Some(ev), &snaps, true).await
    }

    /// A sandbox whose creation failed, recorded as deleted with the
    /// snapshot made for it, in one transaction (best effort: the engine
    /// already failed, and recovery rolls back a pending create anyway).
    pub(crate) async fn abandon_create(
        &self,
        mut rec: SandboxRecord,
        snap: Option<SnapshotRecord>,
        why: String,
        err: &(dyn std::fmt::Display + Sync),
    ) {
        let mut snap = snap;
        if let Some(s) = snap.as_mut() {
            Self::dropped(s, why.clone());
        }
        self.land(&mut rec, SandboxState::Deleted, None);
        rec.state_reason = Some(why);
        let ev = self.event(
            &rec,
            Op::Created,
            Some(SandboxState::Creating),
            Some(SandboxState::Deleted),
            EventPhase::Failed,
            Some(err.to_string()),
        );
        let snaps: Vec<&SnapshotRecord> = snap.iter().collect();
        if let Err(e) = self.write(&mut rec, Some(ev), &snaps, false).await {
            warn!(sandbox = %rec.id, error = %e.message(), "recording a failed create failed");
        }
    }
}
