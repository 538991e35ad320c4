//! Background work: the scheduler's actions and the VM exit watcher.

use super::prelude::*;

/// How long a rolling snapshot waits for a call in flight on its sandbox to
/// end before it is taken anyway.
const ROLLING_DEFER: Duration = Duration::from_secs(10);

/// How long a VM's death waits for the operation that holds its sandbox.
const EXIT_WAIT: Duration = Duration::from_secs(600);

/// The scheduler's view of the service (needs `Arc<Service>` for spawns).
#[derive(Debug, Clone)]
pub struct ScheduledActions(pub Arc<Service>);

#[async_trait]
impl Actions for ScheduledActions {
    async fn rolling_snapshot(&self, id: SandboxId) {
        let svc = &self.0;
        let span = tracing::info_span!("rolling_snapshot", sandbox = %id);
        async {
            // A call in flight (an exec, a file transfer) is someone waiting:
            // the snapshot's pause would land in its latency. Wait for it to
            // end, up to ROLLING_DEFER; a sandbox always in a call (a port
            // tunnel, a long exec) is snapshotted anyway after that.
            let t0 = Instant::now();
            while svc.engine.open_calls(&id).unwrap_or(0) > 0 && t0.elapsed() < ROLLING_DEFER {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
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
            // Hibernate, or delete as the sandbox's lifecycle policy says.
            match svc.idle_timeout_reached(&id, g).await {
                Ok(done) => info!(done, "idle timeout reached"),
                Err(e) => warn!(error = %e.message(), "idle timeout action failed"),
            }
        }
        .instrument(span)
        .await
    }

    async fn gc_sweep(&self) {
        // The journal's retention (`[events] keep`; 0: kept for ever).
        let keep = self.0.config.events.keep;
        if !keep.is_zero() {
            let cutoff = chrono::TimeDelta::from_std(keep)
                .ok()
                .and_then(|k| self.0.now().checked_sub_signed(k));
            if let Some(cutoff) = cutoff {
                match self.0.db(move |s| s.prune_journal(cutoff)).await {
                    Ok(0) => {}
                    Ok(n) => info!(deleted = n, "journal pruned"),
                    Err(e) => warn!(error = %e.message(), "pruning the journal failed"),
                }
            }
        }
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

impl Service {
    /// A VM died behind the daemon's back: mark failed, then restore.
    pub async fn handle_exit(self: &Arc<Self>, id: &SandboxId, reason: &str) {
        if self.warm_died(id) {
            return;
        }
        let span = tracing::info_span!("vm_exit", sandbox = %id);
        async {
            let _g = match self.acquire(id, Op::Fail, Who::User).await {
                Ok(g) => g,
                Err(_) => {
                    // An operation holds the sandbox: it fails, but it does
                    // not record the death. Once it ends, the sandbox is
                    // failed and recovered here unless the operation left a
                    // VM running (a rewind replaces it, a delete ends it).
                    warn!(
                        reason,
                        "vm exited during another operation; handled when it ends"
                    );
                    let Some(g) = self.acquire_when_free(id).await else {
                        return;
                    };
                    let alive = match self.engine.live_vms().await {
                        Ok(vms) => vms.iter().any(|v| &v.id == id),
                        Err(_) => true,
                    };
                    if alive {
                        return;
                    }
                    g
                }
            };
            let Ok(mut rec) = self.record(id).await else {
                return;
            };
            let Ok(next) = rec.state.apply(Op::Fail) else {
                return;
            };
            warn!(reason, "vm died");
            if let Err(e) = self
                .settle(
                    &mut rec,
                    Op::Fail,
                    next,
                    Some(format!("vm died: {reason}")),
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

    /// The op lock of `id` once no operation holds it (polled; at most
    /// [`EXIT_WAIT`]).
    async fn acquire_when_free(&self, id: &SandboxId) -> Option<OpGuard> {
        let t0 = Instant::now();
        while t0.elapsed() < EXIT_WAIT {
            if let Ok(g) = self.acquire(id, Op::Fail, Who::Background).await {
                return Some(g);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        warn!(sandbox = %id, "the operation that saw its VM die did not end; left to recovery");
        None
    }

    /// After an operation that replaces a sandbox's VM (a rewind) failed
    /// while it held the sandbox: when the record still says the sandbox has
    /// a VM and none runs, the failure is recorded (`failed`, with the
    /// operation's error as the reason) and, with `auto_recover`, the sandbox
    /// is restored from its latest snapshot, as [`Service::handle_exit`] does
    /// for a VM that dies between operations. Without this, a VM killed
    /// in the middle of the operation left a `running` record with no VM
    /// behind it (its exit event came while the operation held the sandbox
    /// and was left to it): every call then failed until someone deleted it.
    /// The caller holds the sandbox's operation lock.
    pub(crate) async fn settle_lost_vm(&self, rec: &mut SandboxRecord, op: Op, err: &str) {
        if !rec.state.has_vm() {
            return;
        }
        match self.engine.live_vms().await {
            Ok(live) if !live.iter().any(|v| v.id == rec.id) => {}
            _ => return,
        }
        let Ok(next) = rec.state.apply(Op::Fail) else {
            return;
        };
        let reason = format!("vm gone after a failed {op}: {err}");
        warn!(sandbox = %rec.id, %reason, "no VM left behind a failed operation");
        if let Err(e) = self
            .settle(rec, Op::Fail, next, Some(reason.clone()), Some(reason))
            .await
        {
            warn!(sandbox = %rec.id, error = %e.message(), "recording the failure failed");
            return;
        }
        self.sched.remove(&rec.id);
        self.metrics.count("vm_died");
        if self.config.auto_recover {
            if let Err(e) = self.recover(&rec.id).await {
                warn!(sandbox = %rec.id, error = %e.message(), "recovery failed");
            }
        }
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
}
