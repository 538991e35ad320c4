//! Restoring a failed sandbox from its latest snapshot.

use super::prelude::*;

impl Service {
    /// Restores a failed sandbox from its latest ready snapshot.
    pub async fn recover(&self, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let mut rec = self.record(id).await?;
        let next = rec.state.apply(Op::Recover)?;
        let id2 = id.clone();
        let Some(snap) = self.db(move |s| s.latest_ready_snapshot(&id2)).await? else {
            let reason = format!(
                "{}; no snapshot to restore from",
                rec.state_reason.clone().unwrap_or_default()
            );
            let state = rec.state;
            self.settle(
                &mut rec,
                Op::Recover,
                state,
                Some(reason),
                Some("no snapshot".into()),
            )
            .await?;
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} has no snapshot to restore from"
            )));
        };
        // The latest may be a `same_as` record: restore what it names.
        let snap = self.resolve_same_as(snap).await?;
        let room = self.admit(&rec).await?;
        self.begin(&mut rec, Op::Recover, next, &[], Some(snap.id.to_string()))
            .await?;
        drop(room);
        let started = Instant::now();
        match self.engine.restore(id, &snap.id).await {
            Ok(vm) => {
                self.metrics.observe_step(step::RESTORE, started.elapsed());
                self.done(
                    &mut rec,
                    Op::Recover,
                    next,
                    Some(VmNow::of(&vm)),
                    &[],
                    Some(format!("restored from {}", snap.id)),
                )
                .await?;
                info!(sandbox = %id, snapshot = %snap.id, "restored from latest snapshot");
                Ok(rec)
            }
            Err(e) => {
                self.failed(&mut rec, Op::Recover, &e.message(), &[]).await;
                Err(e.into())
            }
        }
    }
}
