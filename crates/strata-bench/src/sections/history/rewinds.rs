//! The rewinds of the `history` section: to random surviving snapshots,
//! each checked three ways (workspace checksum, RAM marker, the live
//! process's counter), then what a full week would cost at this run's rates.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use rand::SeedableRng;
use serde_json::json;

use super::guest::{counter, read_text, sh, Guest};
use super::plan::{is_activity, pick_rewinds, simulate_kept, tier_of, vtime, Plan};
use super::snapshot_loop::Looped;
use super::workload::GUEST_RAM_DIR;
use super::Args;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples};

/// Rewinds to `--history-rewinds` random surviving snapshots, verifies each
/// and writes the tables, the week estimate and the headline to `sec`;
/// returns the snapshots (virtual times) whose state did not come back.
pub(super) async fn run(
    args: &Args,
    plan: &Plan,
    g: &Guest,
    lp: &Looped,
    sec: &mut Section,
) -> Result<Vec<String>> {
    let (rt, id) = (&g.rt, &g.id);
    let (t0, now, states) = (lp.t0, lp.now, &lp.states);
    let seed = plan.seed;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let picks = pick_rewinds(&lp.live, args.history_rewinds, &mut rng);
    let mut rt_table = Table::new(
        format!("Rewinds to random surviving snapshots (seed {seed}; distinct workspace states first), each verified"),
        &[
            "snapshot",
            "tier",
            "rewind",
            "workspace checksum",
            "RAM marker",
            "counter [at snapshot] → read",
            "process alive",
            "result",
        ],
    );
    let mut rewind_ms = Samples::new();
    let mut failures = Vec::new();
    let mut rewinds_data = Vec::new();
    for s in &picks {
        let t = Instant::now();
        rt.rewind(id, &s.id, None)
            .await
            .with_context(|| format!("rewind to {}", vtime(t0, s.at)))?;
        let r_ms = t.elapsed().as_secs_f64() * 1000.0;
        rewind_ms.push(r_ms);
        let agent = rt.agent(id).await.context("agent after rewind")?;
        let marker = read_text(&agent, &format!("{GUEST_RAM_DIR}/step")).await?;
        let (c1, pid1) = counter(&agent).await?;
        let since = t.elapsed().as_secs_f64();
        let sum = sh(&agent, &g.checksum_cmd).await?.trim().to_owned();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (c2, pid2) = counter(&agent).await?;
        let want = &states[s.state];
        let sum_ok = sum == want.checksum;
        let marker_ok = marker.trim() == s.step.to_string();
        let hi = s.counter_hi + since.ceil() as u64 + 1;
        let counter_ok = c1 >= s.counter_lo && c1 <= hi;
        let alive = pid1 == g.counter_pid && pid2 == pid1 && c2 > c1;
        let ok = sum_ok && marker_ok && counter_ok && alive;
        if !ok {
            failures.push(vtime(t0, s.at));
        }
        let tier = tier_of(&plan.policy, (now - s.at).to_std().unwrap_or_default());
        eprintln!(
            "history: rewind to {} ({}) in {}: checksum {}, marker {}, counter {c1} in [{}, {hi}] {}, alive {alive}",
            vtime(t0, s.at),
            want.label,
            fmt_ms(r_ms),
            if sum_ok { "ok" } else { "MISMATCH" },
            if marker_ok { "ok" } else { "MISMATCH" },
            s.counter_lo,
            if counter_ok { "ok" } else { "OUT OF RANGE" },
        );
        rt_table.row(vec![
            format!("{} (after \"{}\")", vtime(t0, s.at), want.label),
            (tier + 1).to_string(),
            fmt_ms(r_ms),
            if sum_ok {
                format!("match ({}…)", &sum[..12.min(sum.len())])
            } else {
                format!("MISMATCH: {} ≠ {}", &sum, &want.checksum)
            },
            if marker_ok {
                format!("step {} ok", s.step)
            } else {
                format!("MISMATCH: {:?} ≠ {}", marker.trim(), s.step)
            },
            format!("[{}, {}] → {c1}", s.counter_lo, s.counter_hi),
            if alive {
                format!("yes ({c1} → {c2} in 1.5 s)")
            } else {
                format!("NO (pid {pid1}/{pid2}, {c1} → {c2})")
            },
            if ok { "ok".into() } else { "FAILED".into() },
        ]);
        rewinds_data.push(json!({
            "step": s.step, "virtual": vtime(t0, s.at), "rewind_ms": r_ms, "checksum_ok": sum_ok,
            "marker_ok": marker_ok, "counter": [s.counter_lo, s.counter_hi, c1, c2], "alive": alive,
        }));
    }
    sec.table(rt_table);
    let mut rl = Table::latency(
        "Rewind time (Runtime::rewind: from the call to agent-ready)",
        &[],
    );
    rl.latency_row(
        "rewind to a random surviving snapshot",
        &rewind_ms.summary(),
        vec![],
    );
    sec.table(rl);
    week_estimate(plan, lp, sec);
    sec.data["rewinds"] = json!(rewinds_data);
    let rw = rewind_ms.summary();
    sec.headline(format!(
        "{} of {} rewinds to random surviving snapshots restored exactly that state (workspace sha256, RAM marker, live process counter); rewind p50 {} (n={})",
        picks.len() - failures.len(),
        picks.len(),
        fmt_ms(rw.p50),
        rw.n
    ));
    Ok(failures)
}

/// How the rewinds were checked, what the compression cost and what the
/// full week would take at this run's rates (text and data of `sec`).
fn week_estimate(plan: &Plan, lp: &Looped, sec: &mut Section) {
    let (every, steps, burst_every) = (plan.every, plan.steps, plan.burst_every);
    let (loop_s, states) = (lp.loop_s, &lp.states);
    let week = 7 * 1440;
    let week_steps = week / every;
    let week_activity = (0..week_steps)
        .filter(|i| is_activity(i * every, every, burst_every))
        .count() as f64;
    let act_total_ms: f64 = states.iter().map(|s| s.activity_ms + s.checksum_ms).sum();
    let idle_ms = (loop_s * 1000.0 - act_total_ms) / steps as f64;
    let act_ms = act_total_ms / states.len().max(1) as f64;
    let week_est_min = (week_steps as f64 * idle_ms + week_activity * act_ms) / 60_000.0;
    let week_kept = simulate_kept(&plan.policy, every, week, lp.t0);
    sec.text(format!(
        "Each rewind is checked three ways: the workspace checksum equals the one recorded after the activity step the \
         snapshot followed (disk state); the tmpfs marker holds exactly the snapshot's step number (RAM state of that \
         very snapshot, not a neighbour's); and the long-running process is the same pid, its counter read right after \
         the rewind lies between the values read just before and just after that snapshot (plus the seconds since the \
         rewind began), and it keeps counting.\n\n\
         **Compression.** {steps} steps of {every} virtual minute(s) ran in {loop_s:.0} s of real time: {} per \
         virtual minute without activity (snapshot + RAM marker + retention + deletes), {} per activity step (guest \
         exec + checksum). Under TCG on this 2-core machine one virtual minute costs tens to hundreds of ms of real time, so the default run covers \
         {:.2} virtual days to stay within its time budget. The full week is \
         `strata-bench --accel tcg --only history --history-days 7` ({week_steps} snapshots, {} activity steps): \
         estimated from this run's rates at {week_est_min:.0} min. The same retention policy run alone over a week \
         of one point per {every} min keeps {week_kept} snapshots (the tiers above fill up; the 7-day tier is only \
         reached by runs longer than a day).\n\n\
         **What the pool holds.** Pool growth counts the RAM file too: every page the guest dirties between two \
         kept snapshots (page cache, the counter process, the kernel) is a copied 4 KiB block of the memory file, \
         which the guest's disk-write counter does not see; and a deleted snapshot's blocks are freed only when no \
         kept snapshot shares them.",
        fmt_ms(idle_ms),
        fmt_ms(act_ms),
        plan.days(),
        week_activity,
    ));
    sec.data["week_estimate"] = json!({
        "steps": week_steps, "activity_steps": week_activity, "idle_ms_per_step": idle_ms,
        "activity_ms_per_step": act_ms, "minutes": week_est_min, "retention_kept": week_kept,
    });
}
