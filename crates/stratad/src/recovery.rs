//! Start-up reconciliation of the records with what runs on the host.
//!
//! Order:
//! 1. snapshots left `pending` by a crash are rolled back (recorded as
//!    deleted, their subvolume removed): a pending snapshot is never listed
//!    as ready;
//! 2. each sandbox record is compared with the live VMs: a VM that survived
//!    is adopted (and paused/continued to match the record); an operation
//!    left pending is completed if the VM shows it finished (a create whose
//!    VM runs) or rolled back otherwise (the previous state stands); a
//!    sandbox whose VM is gone is marked failed and restored from its latest
//!    ready snapshot (or stays failed, with the reason);
//! 3. orphans — VMs and subvolumes no record owns — are reported; the VMs
//!    (found by their command line, pid file or not, template builders
//!    included) are always ended, the subvolumes removed with
//!    `clean_orphans`; ready snapshots whose subvolume vanished are recorded
//!    as deleted.
//!
//! If the engine cannot list VMs or subvolumes, reconciliation is skipped
//! (reported) rather than taking "nothing found" for "everything died".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;
use strata_core::{Op, SandboxId, SandboxState, SnapshotId};
use tracing::{info, warn};

use crate::engine::LiveVm;
use crate::service::VmNow;
use crate::service::{Service, ServiceResult};
use crate::store::{SnapshotStatus, TemplateStatus};

/// How long an adopted, running VM's agent has to answer before recovery
/// restores the sandbox from its last snapshot instead: room for a session
/// that goes silent (found within 5 s) and a fresh one after it.
const AGENT_PROBE: std::time::Duration = std::time::Duration::from_secs(20);

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RecoveryReport {
    /// Pending snapshots rolled back.
    pub rolled_back_snapshots: Vec<SnapshotId>,
    /// Sandboxes whose VM was adopted.
    pub adopted: Vec<SandboxId>,
    /// Pending operations completed or rolled back: `(sandbox, op, outcome)`.
    pub pending_ops: Vec<(SandboxId, String, String)>,
    /// Sandboxes restored from their latest snapshot.
    pub restored: Vec<SandboxId>,
    /// Sandboxes left failed, with the reason.
    pub failed: Vec<(SandboxId, String)>,
    /// VMs without a record, ended: `(id, pid)`.
    pub orphan_vms: Vec<(SandboxId, u32)>,
    /// VM processes of the run dir that belong to no sandbox (a template
    /// build's builder), ended: their run-dir names.
    pub stray_vms: Vec<String>,
    /// Subvolumes without a record.
    pub orphan_subvolumes: Vec<String>,
    /// Ready snapshots whose subvolume is gone.
    pub missing_snapshots: Vec<SnapshotId>,
    /// Template builds interrupted by the restart (now failed).
    pub interrupted_templates: Vec<String>,
    /// Why reconciliation with the engine was skipped, if it was.
    pub skipped: Option<String>,
}

/// A create the restart interrupted: its VM (if any) goes, the record is
/// deleted with the reason.
async fn roll_back_create(
    svc: &Arc<Service>,
    rec: &mut crate::store::SandboxRecord,
    why: String,
    report: &mut RecoveryReport,
) -> ServiceResult<()> {
    let _ = svc.engine().delete(&rec.id).await;
    svc.recovered(
        rec,
        Op::Created,
        SandboxState::Deleted,
        None,
        Some(why),
        "create rolled back".into(),
    )
    .await?;
    report
        .pending_ops
        .push((rec.id.clone(), "created".into(), "rolled back".into()));
    Ok(())
}

/// Reconciles; see the module documentation.
pub async fn reconcile(svc: &Arc<Service>) -> ServiceResult<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let engine = svc.engine().clone();

    // 1. Pending snapshots.
    for mut s in svc.db(|st| st.pending_snapshots()).await? {
        s.status = SnapshotStatus::Deleted;
        s.status_reason = Some("interrupted by a daemon restart".into());
        let s2 = s.clone();
        svc.db(move |st| st.put_snapshot(&s2)).await?;
        let _ = engine.delete_snapshot(&s.id).await;
        warn!(snapshot = %s.id, sandbox = %s.sandbox_id, "rolled back a snapshot left pending");
        report.rolled_back_snapshots.push(s.id);
    }

    let records = svc.db(|st| st.live_sandboxes()).await?;
    let (live, subs) = match (engine.live_vms().await, engine.subvolumes().await) {
        (Ok(l), Ok(s)) => (l, s),
        (Err(e), _) | (_, Err(e)) => {
            warn!(error = %e.message(), "engine cannot list VMs/subvolumes; records left as they are");
            report.skipped = Some(e.message());
            for r in &records {
                svc.reschedule(r);
            }
            return Ok(report);
        }
    };
    let live: HashMap<SandboxId, LiveVm> = live.into_iter().map(|v| (v.id.clone(), v)).collect();
    let known: HashSet<SandboxId> = records.iter().map(|r| r.id.clone()).collect();

    // 2. Sandboxes.
    let mut to_restore = Vec::new();
    for mut rec in records {
        let id = rec.id.clone();
        let vm = live.get(&id);
        let pending = rec.pending_op;
        match (pending, vm) {
            (Some(Op::Created), Some(_)) => match engine.adopt(&id).await {
                Ok(info) => {
                    svc.recovered(
                        &mut rec,
                        Op::Created,
                        SandboxState::Running,
                        Some(VmNow::of(&info)),
                        None,
                        "create completed after restart".into(),
                    )
                    .await?;
                    report
                        .pending_ops
                        .push((id.clone(), "created".into(), "completed".into()));
                    report.adopted.push(id.clone());
                }
                Err(e) => {
                    let why = format!("create interrupted: {}", e.message());
                    roll_back_create(svc, &mut rec, why, &mut report).await?;
                }
            },
            (Some(Op::Created), None) => {
                let why = "create interrupted by a daemon restart".to_owned();
                roll_back_create(svc, &mut rec, why, &mut report).await?;
            }
            (Some(Op::Delete), _) => {
                let _ = engine.delete(&id).await;
                let id2 = id.clone();
                for mut s in svc.db(move |st| st.list_snapshots(&id2, false)).await? {
                    s.status = SnapshotStatus::Deleted;
                    s.status_reason = Some("sandbox deleted".into());
                    let s2 = s.clone();
                    svc.db(move |st| st.put_snapshot(&s2)).await?;
                    let _ = engine.delete_snapshot(&s.id).await;
                }
                svc.recovered(
                    &mut rec,
                    Op::Delete,
                    SandboxState::Deleted,
                    None,
                    None,
                    "delete completed after restart".into(),
                )
                .await?;
                report
                    .pending_ops
                    .push((id.clone(), "delete".into(), "completed".into()));
            }
            (_, Some(_)) => {
                // The VM lives. Adopt it and make it match the record; an
                // interrupted pause/resume/snapshot/rewind keeps the recorded state.
                let adopted = engine.adopt(&id).await;
                match adopted {
                    Ok(info) => {
                        let next = match rec.state {
                            SandboxState::Hibernated => {
                                rec.state.apply(Op::Resume).unwrap_or(rec.state)
                            }
                            SandboxState::Failed => {
                                rec.state.apply(Op::Recover).unwrap_or(rec.state)
                            }
                            SandboxState::Creating => {
                                rec.state.apply(Op::Created).unwrap_or(rec.state)
                            }
                            s => s,
                        };
                        // Always re-assert the recorded run state (pause and resume
                        // are idempotent): the listing does not say whether a VM runs,
                        // and a daemon killed in the middle of a snapshot leaves it stopped.
                        let fix = match next {
                            SandboxState::Running => engine.resume(&id).await,
                            SandboxState::Paused => engine.pause(&id).await,
                            _ => Ok(()),
                        };
                        if let Err(e) = fix {
                            warn!(sandbox = %id, error = %e.message(), "adopted VM does not match its record");
                        }
                        // A running guest must answer: one whose agent stays
                        // silent (e.g. a VM stopped mid-snapshot and continued)
                        // is restored from its last snapshot, with the reason.
                        let silent = match next {
                            SandboxState::Running => {
                                engine.probe_agent(&id, AGENT_PROBE).await.err()
                            }
                            _ => None,
                        };
                        if let Some(e) = silent {
                            let why = format!(
                                "agent did not answer after the restart ({}); restored from the last snapshot",
                                e.message()
                            );
                            warn!(sandbox = %id, error = %e.message(), "adopted VM's agent is silent; restoring");
                            let _ = engine.delete(&id).await;
                            svc.recovered(
                                &mut rec,
                                pending.unwrap_or(Op::Fail),
                                SandboxState::Failed,
                                None,
                                Some(why.clone()),
                                why,
                            )
                            .await?;
                            if let Some(op) = pending {
                                report.pending_ops.push((
                                    id.clone(),
                                    op.to_string(),
                                    "rolled back".into(),
                                ));
                            }
                            to_restore.push(id.clone());
                            svc.reschedule(&rec);
                            continue;
                        }
                        let detail = match pending {
                            Some(op) => {
                                report.pending_ops.push((
                                    id.clone(),
                                    op.to_string(),
                                    "rolled back".into(),
                                ));
                                format!("adopted after restart; {op} rolled back")
                            }
                            None => "adopted after restart".into(),
                        };
                        svc.recovered(
                            &mut rec,
                            pending.unwrap_or(Op::Resume),
                            next,
                            Some(VmNow::pid(info.pid)),
                            None,
                            detail,
                        )
                        .await?;
                        report.adopted.push(id.clone());
                    }
                    Err(e) => {
                        warn!(sandbox = %id, error = %e.message(), "adopting the VM failed; restoring instead");
                        let _ = engine.delete(&id).await;
                        if rec.state.has_vm() {
                            svc.recovered(
                                &mut rec,
                                Op::Fail,
                                SandboxState::Failed,
                                None,
                                Some(format!("vm could not be adopted: {}", e.message())),
                                e.message(),
                            )
                            .await?;
                        }
                        to_restore.push(id.clone());
                    }
                }
            }
            (_, None) => {
                if let Some(op) = pending {
                    report
                        .pending_ops
                        .push((id.clone(), op.to_string(), "rolled back".into()));
                }
                if rec.state.has_vm() {
                    let next = rec.state.apply(Op::Fail).unwrap_or(SandboxState::Failed);
                    svc.recovered(
                        &mut rec,
                        Op::Fail,
                        next,
                        None,
                        Some("vm gone after a daemon or host restart".into()),
                        "vm not found at start".into(),
                    )
                    .await?;
                    to_restore.push(id.clone());
                } else {
                    if pending.is_some() {
                        let st = rec.state;
                        svc.recovered(
                            &mut rec,
                            pending.unwrap_or(Op::Resume),
                            st,
                            None,
                            None,
                            "rolled back after restart".into(),
                        )
                        .await?;
                    }
                    if rec.state == SandboxState::Failed {
                        to_restore.push(id.clone());
                    }
                }
            }
        }
        if rec.state != SandboxState::Deleted {
            svc.reschedule(&rec);
        }
    }

    // 3. Orphans. A VM no record owns is always ended: nothing acknowledged
    // lives in it, and it holds CPU and memory outside admission's
    // accounting. `clean_orphans` decides about subvolumes (kept, it off,
    // for inspection).
    let clean = svc.config().clean_orphans;
    for (id, vm) in &live {
        if !known.contains(id) {
            warn!(sandbox = %id, pid = vm.pid, "ending an orphaned VM");
            report.orphan_vms.push((id.clone(), vm.pid));
            let _ = engine.delete(id).await;
        }
    }
    match engine.end_strays().await {
        Ok(names) => report.stray_vms = names,
        Err(e) => warn!(error = %e.message(), "cannot end stray VMs"),
    }
    for id in &subs.sandboxes {
        if !known.contains(id) && !live.contains_key(id) {
            report.orphan_subvolumes.push(format!("sandboxes/{id}"));
            if clean {
                let _ = engine.delete(id).await;
            }
        }
    }
    let ready: HashSet<SnapshotId> = svc
        .db(|st| st.ready_snapshot_ids())
        .await?
        .into_iter()
        .collect();
    let on_disk: HashSet<SnapshotId> = subs.snapshots.iter().cloned().collect();
    // The replicas this cluster host holds of other hosts' sandboxes are
    // not orphans (docs/cluster.md "Replicas"); unknown: remove none.
    let replicas: Option<HashSet<String>> = match svc.cluster() {
        None => Some(HashSet::new()),
        Some(c) => match c.held_replicas().await {
            Ok(r) => Some(r.into_iter().collect()),
            Err(e) => {
                warn!(error = %e.message(), "cannot read this host's replicas: no snapshot subvolume removed as an orphan");
                None
            }
        },
    };
    for id in &subs.snapshots {
        let replica = replicas.as_ref().is_none_or(|r| r.contains(id.as_str()));
        if !ready.contains(id) && !replica {
            report.orphan_subvolumes.push(format!("snapshots/{id}"));
            if clean {
                let _ = engine.delete_snapshot(id).await;
            }
        }
    }
    for id in ready.difference(&on_disk) {
        let id2 = id.clone();
        if let Some(mut s) = svc.db(move |st| st.get_snapshot(&id2)).await? {
            // A `same_as` record has no subvolume of its own: it stands
            // while the snapshot it names is there.
            let why = match &s.same_as {
                Some(t) if ready.contains(t) && on_disk.contains(t) => continue,
                Some(t) => format!("the snapshot it is the same as ({t}) is missing from the pool"),
                None => "subvolume missing from the pool".into(),
            };
            s.status = SnapshotStatus::Deleted;
            s.status_reason = Some(why);
            svc.db(move |st| st.put_snapshot(&s)).await?;
            report.missing_snapshots.push(id.clone());
        }
    }
    // Template builds are not resumable: one interrupted by the restart failed.
    for mut t in svc.db(|st| st.all_templates()).await? {
        if t.status == TemplateStatus::Building {
            t.status = TemplateStatus::Failed;
            t.status_reason = Some("build interrupted by a daemon restart".into());
            t.updated_at = svc.now();
            warn!(template = %t.id, "template build interrupted by the restart");
            let _ = engine.delete_template(&t.id).await;
            report.interrupted_templates.push(t.id.to_string());
            svc.db(move |st| st.put_template(&t)).await?;
        }
    }
    let templates: HashSet<_> = svc
        .db(|st| st.all_templates())
        .await?
        .into_iter()
        .filter(|t| t.status != TemplateStatus::Deleted)
        .map(|t| t.id)
        .collect();
    for id in &subs.templates {
        if !templates.contains(id) {
            report.orphan_subvolumes.push(format!("templates/{id}"));
            if clean {
                let _ = engine.delete_template(id).await;
            }
        }
    }

    // 4. Restores (after orphans are gone: they free capacity).
    if svc.config().auto_recover {
        for id in to_restore {
            match svc.recover(&id).await {
                Ok(_) => report.restored.push(id),
                Err(e) => report.failed.push((id, e.message())),
            }
        }
    }
    info!(
        adopted = report.adopted.len(),
        restored = report.restored.len(),
        failed = report.failed.len(),
        orphans = report.orphan_vms.len() + report.orphan_subvolumes.len(),
        "recovery done"
    );
    Ok(report)
}
