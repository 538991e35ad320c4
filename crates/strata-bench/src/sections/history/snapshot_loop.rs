//! The loop of the `history` section: on the virtual clock, each step runs
//! the agent's activity when one is due, writes the RAM marker, takes a real
//! snapshot stamped with the step's virtual time, measures what the guest
//! changed since the previous snapshot, and applies the daemon's retention
//! at that virtual "now", deleting for real what it selects.

use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use chrono::{DateTime, TimeZone, Utc};
use strata_core::SnapshotId;
use strata_runtime::meta::files;
use strata_storage::{file_extent_map, rewritten_bytes, FileExtent};
use stratad::retention::Point;
use stratad::store::SnapshotKind;

use super::guest::{counter, disk_written, sh, write_bytes, Guest};
use super::plan::{is_activity, vtime, Plan};
use super::workload::{self, GUEST_RAM_DIR};
use super::{Snap, State};
use crate::stats::{fmt_bytes, Samples};

/// What the loop measured.
pub(super) struct Looped {
    /// The virtual epoch (step 0).
    pub(super) t0: DateTime<Utc>,
    /// The virtual time of the last step.
    pub(super) now: DateTime<Utc>,
    /// Pool bytes used before the loop.
    pub(super) used_start: u64,
    /// The snapshots retention kept, oldest first.
    pub(super) live: Vec<Snap>,
    /// The workspace after each activity step.
    pub(super) states: Vec<State>,
    /// vCPU pause of each snapshot, ms.
    pub(super) pauses: Samples,
    /// Each `Runtime::snapshot` call, ms.
    pub(super) snap_calls: Samples,
    /// Each retention delete, ms.
    pub(super) deletes: Samples,
    /// RAM marker write + counter read per step, ms.
    pub(super) probes: Samples,
    /// Each activity step, ms.
    pub(super) activity_ms: Samples,
    /// Each workspace checksum, ms.
    pub(super) checksum_ms: Samples,
    /// (virtual days, pool bytes above the start) after each step.
    pub(super) used_series: Vec<(f64, f64)>,
    /// (virtual days, snapshots kept) after each step.
    pub(super) kept_series: Vec<(f64, f64)>,
    /// (virtual days, guest disk writes) after each activity step.
    pub(super) written_series: Vec<(f64, f64)>,
    /// (virtual days, RAM + disk changed between snapshots, cumulative).
    pub(super) changed_series: Vec<(f64, f64)>,
    /// Snapshots retention deleted.
    pub(super) deleted: usize,
    /// Guest disk writes during the loop, bytes.
    pub(super) last_written: u64,
    /// RAM + disk changed between consecutive snapshots, summed, bytes.
    pub(super) changed: u64,
    /// Real seconds the loop took.
    pub(super) loop_s: f64,
    /// Snapshots per real second.
    pub(super) rate: f64,
}

/// Runs the `plan.steps` steps of the loop in `g`.
pub(super) async fn run(plan: &Plan, g: &Guest) -> Result<Looped> {
    let (rt, id, agent) = (&g.rt, &g.id, &g.agent);
    let (every, steps, burst_every, policy) =
        (plan.every, plan.steps, plan.burst_every, &plan.policy);
    let t0 = Utc
        .with_ymd_and_hms(2026, 1, 5, 0, 0, 0)
        .single()
        .ok_or_else(|| anyhow!("virtual epoch"))?;
    let used_start = rt.pool().usage().context("pool usage")?.used_bytes;
    let mut live: Vec<Snap> = Vec::new();
    let mut states: Vec<State> = Vec::new();
    let mut pauses = Samples::new();
    let mut snap_calls = Samples::new();
    let mut deletes = Samples::new();
    let mut probes = Samples::new();
    let mut activity_ms = Samples::new();
    let mut checksum_ms = Samples::new();
    let mut used_series: Vec<(f64, f64)> = Vec::new();
    let mut kept_series: Vec<(f64, f64)> = Vec::new();
    let mut written_series: Vec<(f64, f64)> = vec![(0.0, 0.0)];
    let mut activity = 0u64;
    let mut deleted = 0usize;
    let mut last_written = 0u64;
    let mut last_counter = g.first_counter;
    // What the guest changed between consecutive snapshots, RAM and disk:
    // the extents of each snapshot's `mem` and `disk.img` that moved since
    // the previous snapshot (copy-on-write), compared while both exist.
    let mut changed = 0u64;
    let mut changed_series: Vec<(f64, f64)> = vec![(0.0, 0.0)];
    let mut prev_maps: Option<(Vec<FileExtent>, Vec<FileExtent>)> = None;
    let t_loop = Instant::now();
    for i in 0..steps {
        let minute = i * every;
        let at = t0 + chrono::Duration::minutes(minute as i64);
        let days = minute as f64 / 1440.0;
        if is_activity(minute, every, burst_every) {
            let st = workload::step(activity);
            let t = Instant::now();
            sh(agent, &st.script)
                .await
                .with_context(|| format!("activity step {activity} ({})", st.label))?;
            let a_ms = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let checksum = sh(agent, &g.checksum_cmd).await?.trim().to_owned();
            let c_ms = t.elapsed().as_secs_f64() * 1000.0;
            if checksum.len() != 64 {
                bail!("workspace checksum: unexpected output {checksum:?}");
            }
            last_written = disk_written(agent).await?.saturating_sub(g.written0);
            written_series.push((days, last_written as f64));
            activity_ms.push(a_ms);
            checksum_ms.push(c_ms);
            states.push(State {
                step: activity,
                label: st.label,
                minute,
                checksum,
                activity_ms: a_ms,
                checksum_ms: c_ms,
                disk_written: last_written,
            });
            activity += 1;
        }
        let state = states
            .len()
            .checked_sub(1)
            .ok_or_else(|| anyhow!("no activity before the first snapshot"))?;
        let t = Instant::now();
        write_bytes(
            agent,
            &format!("{GUEST_RAM_DIR}/step"),
            i.to_string().as_bytes(),
        )
        .await?;
        let probe_ms = t.elapsed().as_secs_f64() * 1000.0;
        let snap = SnapshotId::generate();
        let t = Instant::now();
        let info = rt
            .snapshot(id, &snap)
            .await
            .with_context(|| format!("snapshot at step {i}"))?;
        snap_calls.push_dur(t.elapsed());
        pauses.push(info.pause_ms);
        let dir = rt.pool().snapshots_dir().join(snap.as_str());
        let maps = tokio::task::spawn_blocking(move || -> Result<_> {
            let m = file_extent_map(&dir.join(files::MEM)).map_err(|e| anyhow!("{e}"))?;
            let d = file_extent_map(&dir.join(files::DISK)).map_err(|e| anyhow!("{e}"))?;
            Ok((m, d))
        })
        .await??;
        if let Some((pm, pd)) = &prev_maps {
            changed += rewritten_bytes(pm, &maps.0) + rewritten_bytes(pd, &maps.1);
            changed_series.push((days, changed as f64));
        }
        prev_maps = Some(maps);
        let t = Instant::now();
        let (c, _) = counter(agent).await?;
        probes.push(probe_ms + t.elapsed().as_secs_f64() * 1000.0);
        live.push(Snap {
            id: snap,
            step: i,
            at,
            state,
            counter_lo: last_counter,
            counter_hi: c,
        });
        last_counter = c;
        let points: Vec<Point<u64>> = live
            .iter()
            .map(|s| Point {
                id: s.step,
                at: s.at,
                kind: SnapshotKind::Rolling,
            })
            .collect();
        let doomed = policy.to_delete(&points, at);
        for step in doomed {
            let Some(pos) = live.iter().position(|s| s.step == step) else {
                continue;
            };
            let s = live.remove(pos);
            let t = Instant::now();
            rt.delete_snapshot(&s.id)
                .await
                .with_context(|| format!("delete snapshot of step {}", s.step))?;
            deletes.push_dur(t.elapsed());
            deleted += 1;
        }
        let used = rt.pool().usage().context("pool usage")?.used_bytes;
        used_series.push((days, used.saturating_sub(used_start) as f64));
        kept_series.push((days, live.len() as f64));
        if (i + 1) % (steps / 10).max(1) == 0 || i + 1 == steps {
            eprintln!(
                "history: {}/{steps} snapshots ({}), {} kept, pool +{}, guest wrote {}, {:.1} snapshots/s",
                i + 1,
                vtime(t0, at),
                live.len(),
                fmt_bytes(used.saturating_sub(used_start) as f64),
                fmt_bytes(last_written as f64),
                (i + 1) as f64 / t_loop.elapsed().as_secs_f64()
            );
        }
    }
    let loop_s = t_loop.elapsed().as_secs_f64();
    Ok(Looped {
        t0,
        now: t0 + chrono::Duration::minutes(((steps - 1) * every) as i64),
        used_start,
        live,
        states,
        pauses,
        snap_calls,
        deletes,
        probes,
        activity_ms,
        checksum_ms,
        used_series,
        kept_series,
        written_series,
        changed_series,
        deleted,
        last_written,
        changed,
        loop_s,
        rate: steps as f64 / loop_s,
    })
}
