//! What the `history` section reports once the loop is done: the bytes at
//! the end (pool growth against guest writes, changed RAM + disk and the
//! logical size of the kept snapshots), the survivors per retention tier,
//! the space of single snapshots, the loop's times, the plot and the
//! headline.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::json;
use stratad::duration::format_duration;

use super::guest::Guest;
use super::plan::{thin, tier_of, vtime, Plan};
use super::snapshot_loop::Looped;
use super::{Args, Snap};
use crate::ctx::Ctx;
use crate::plot::{self, Series};
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_ratio};

/// Measures the bytes at the end of the loop and writes the tables, the
/// plot, the loop's data and the headline to `sec`.
pub(super) async fn write(
    ctx: &Ctx,
    args: &Args,
    plan: &Plan,
    g: &Guest,
    lp: &Looped,
    sec: &mut Section,
) -> Result<()> {
    let (rt, id) = (&g.rt, &g.id);
    let (every, steps) = (plan.every, plan.steps);
    let (t0, used_start, live) = (lp.t0, lp.used_start, &lp.live);

    // ---------------------------------------------------------------- bytes at the end
    let t_settle = Instant::now();
    {
        let rt2 = rt.clone();
        tokio::task::spawn_blocking(move || rt2.pool().wait_trash_empty())
            .await
            .context("wait for the trash")?;
    }
    let root = rt.pool().root().to_path_buf();
    for args in [["subvolume", "sync"], ["filesystem", "sync"]] {
        let r = root.clone();
        let _ = tokio::task::spawn_blocking(move || {
            std::process::Command::new("btrfs")
                .args(args)
                .arg(&r)
                .output()
        })
        .await;
    }
    let settle_s = t_settle.elapsed().as_secs_f64();
    let used_end = rt
        .pool()
        .usage()
        .context("pool usage")?
        .used_bytes
        .saturating_sub(used_start);
    let disk_meta = std::fs::metadata(
        rt.pool()
            .sandboxes_dir()
            .join(id.as_str())
            .join(strata_runtime::meta::files::DISK),
    )
    .context("stat the sandbox disk")?;
    let disk_alloc = {
        use std::os::unix::fs::MetadataExt;
        disk_meta.blocks() * 512
    };
    let mem_bytes = u64::from(args.history_mem) << 20;
    let per_full = mem_bytes + disk_alloc;
    let logical = per_full * live.len() as u64;
    let mut usage_rows = Vec::new();
    {
        let picks: Vec<&Snap> = {
            let mut v = vec![&live[0], &live[live.len() / 2], &live[live.len() - 1]];
            v.dedup_by_key(|s| s.step);
            v
        };
        for s in picks {
            let t = Instant::now();
            match rt.snapshot_usage(&s.id).await {
                Ok(u) => usage_rows.push(vec![
                    vtime(t0, s.at),
                    fmt_bytes(u.exclusive_bytes as f64),
                    fmt_bytes(u.referenced_bytes as f64),
                    fmt_ms(t.elapsed().as_secs_f64() * 1000.0),
                ]),
                Err(e) => usage_rows.push(vec![
                    vtime(t0, s.at),
                    format!("error: {e}"),
                    "–".into(),
                    "–".into(),
                ]),
            }
        }
    }

    sec.table(tiers_table(plan, lp));

    let mut bytes = Table::new(
        format!(
            "Bytes at the end of {:.2} virtual days (pool figures after the trash emptied and btrfs synced: {settle_s:.1} s)",
            plan.days()
        ),
        &["figure", "bytes", "note"],
    );
    bytes.row(vec![
        "pool bytes used above the start of the loop".into(),
        fmt_bytes(used_end as f64),
        format!(
            "btrfs statfs used, end − start; {} kept snapshots + the live sandbox's new data",
            live.len()
        ),
    ]);
    bytes.row(vec![
        "guest disk writes during the loop".into(),
        fmt_bytes(lp.last_written as f64),
        format!(
            "sectors written by the guest kernel to its disk; pool / writes = {}",
            fmt_ratio(used_end as f64, lp.last_written as f64)
        ),
    ]);
    bytes.row(vec![
        "RAM + disk the guest changed, snapshot to snapshot".into(),
        fmt_bytes(lp.changed as f64),
        format!(
            "extents of `mem` and `disk.img` rewritten between consecutive snapshots (FIEMAP), summed \
             over all {steps}; retention drops the intermediate states: pool / changed = {}",
            fmt_ratio(used_end as f64, lp.changed as f64)
        ),
    ]);
    bytes.row(vec![
        "logical RAM + disk of the kept snapshots".into(),
        fmt_bytes(logical as f64),
        format!(
            "{} × ({} RAM + {} allocated disk): what full copies would take; {} of it used",
            live.len(),
            fmt_bytes(mem_bytes as f64),
            fmt_bytes(disk_alloc as f64),
            fmt_ratio(used_end as f64 * 100.0, logical as f64).replace('×', " %")
        ),
    ]);
    bytes.row(vec![
        "pool bytes per kept snapshot".into(),
        fmt_bytes(used_end as f64 / live.len().max(1) as f64),
        "pool growth / kept snapshots".into(),
    ]);
    sec.table(bytes);
    let mut ut = Table::new(
        "Space of single snapshots at the end (btrfs extent accounting, `Runtime::snapshot_usage`)",
        &["snapshot", "exclusive", "referenced", "time to measure"],
    );
    for r in usage_rows {
        ut.row(r);
    }
    sec.table(ut);
    sec.table(times_table(plan, lp));

    let file = "history-bytes.svg";
    let mib = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        thin(v, 400)
            .into_iter()
            .map(|(x, y)| (x, y / 1048576.0))
            .collect()
    };
    plot::lines(
        &ctx.file(file),
        &format!(
            "{:.1} virtual days, 1 snapshot / {every} min, retention applied",
            plan.days()
        ),
        "virtual days",
        "MiB  (snapshots kept: count)",
        &[
            Series::new("pool bytes used above start (MiB)", mib(&lp.used_series)),
            Series::new(
                "cumulative guest disk writes (MiB)",
                mib(&lp.written_series),
            ),
            Series::new(
                "cumulative RAM + disk changed between snapshots (MiB)",
                mib(&thin(&lp.changed_series, 1000)),
            ),
            Series::new("snapshots kept (count)", thin(&lp.kept_series, 400)),
        ],
        false,
    )?;
    sec.plot(
        file,
        "Pool bytes used (above the start of the loop), the guest's cumulative disk writes and the RAM + disk it changed between snapshots, in MiB, and the number of snapshots kept, over virtual time",
    );
    sec.data["loop"] = json!({
        "seconds": lp.loop_s, "snapshots_per_s": lp.rate, "deleted": lp.deleted, "kept": live.len(),
        "used_start": used_start, "used_end_above_start": used_end, "guest_written": lp.last_written,
        "mem_bytes": mem_bytes, "disk_allocated": disk_alloc, "logical_kept": logical,
        "pause_ms": lp.pauses.0, "snapshot_call_ms": lp.snap_calls.0, "delete_ms": lp.deletes.0,
        "probe_ms": lp.probes.0, "states": lp.states,
        "used_series": thin(&lp.used_series, 1000), "kept_series": thin(&lp.kept_series, 1000),
        "written_series": lp.written_series, "changed": lp.changed,
        "changed_series": thin(&lp.changed_series, 1000),
    });
    let pause = lp.pauses.summary();
    sec.headline(format!(
        "{steps} real snapshots ({:.2} virtual days at 1 per {every} min) at {:.1} snapshots/s with the daemon's retention: {} kept; pool grew {} while the guest wrote {} to disk and changed {} of RAM + disk between snapshots, vs {} logical RAM + disk in the kept snapshots; pause p50 {} / p99 {} (n={})",
        plan.days(),
        lp.rate,
        live.len(),
        fmt_bytes(used_end as f64),
        fmt_bytes(lp.last_written as f64),
        fmt_bytes(lp.changed as f64),
        fmt_bytes(logical as f64),
        fmt_ms(pause.p50),
        fmt_ms(pause.p99),
        pause.n,
    ));
    Ok(())
}

/// Surviving snapshots per retention tier at the end of the loop.
fn tiers_table(plan: &Plan, lp: &Looped) -> Table {
    let (policy, every, steps) = (&plan.policy, plan.every, plan.steps);
    let (t0, now, live) = (lp.t0, lp.now, &lp.live);
    let mut tiers = Table::new(
        format!(
            "Surviving snapshots per retention tier at the end ({} taken, {} deleted by retention, {} kept)",
            steps,
            lp.deleted,
            live.len()
        ),
        &["tier (age)", "rule", "kept", "expected", "oldest kept", "newest kept"],
    );
    let mut prev = Duration::ZERO;
    for (ti, t) in policy.tiers.iter().enumerate() {
        let in_tier: Vec<&Snap> = live
            .iter()
            .filter(|s| tier_of(policy, (now - s.at).to_std().unwrap_or_default()) == ti)
            .collect();
        // What the tier can hold over the span actually covered by the run.
        let span_min = ((steps * every) as f64).min(t.within.as_secs_f64() / 60.0)
            - (prev.as_secs_f64() / 60.0);
        let expected = if span_min <= 0.0 {
            0.0
        } else if t.every.is_zero() {
            span_min / every as f64
        } else {
            span_min / (t.every.as_secs_f64() / 60.0).max(every as f64)
        };
        let f = format_duration;
        tiers.row(vec![
            format!("{} – {}", f(prev), f(t.within)),
            if t.every.is_zero() {
                "all".into()
            } else {
                format!("1 per {}", f(t.every))
            },
            in_tier.len().to_string(),
            format!("≈{expected:.0}"),
            in_tier
                .first()
                .map(|s| vtime(t0, s.at))
                .unwrap_or_else(|| "–".into()),
            in_tier
                .last()
                .map(|s| vtime(t0, s.at))
                .unwrap_or_else(|| "–".into()),
        ]);
        prev = t.within;
    }
    let beyond = live
        .iter()
        .filter(|s| {
            tier_of(policy, (now - s.at).to_std().unwrap_or_default()) == policy.tiers.len()
        })
        .count();
    tiers.row(vec![
        format!("older than {}", format_duration(prev)),
        "deleted".into(),
        beyond.to_string(),
        "0".into(),
        "–".into(),
        "–".into(),
    ]);
    tiers
}

/// The times measured during the loop.
fn times_table(plan: &Plan, lp: &Looped) -> Table {
    let mut lat = Table::latency(
        format!(
            "Times during the loop: {} snapshots in {:.1} s = {:.2} snapshots/s sustained (with retention, deletes, activity and probes)",
            plan.steps, lp.loop_s, lp.rate
        ),
        &[],
    );
    for (name, samples) in [
        ("snapshot pause (vCPUs stopped)", &lp.pauses),
        ("snapshot call (Runtime::snapshot)", &lp.snap_calls),
        ("retention delete (Runtime::delete_snapshot)", &lp.deletes),
        (
            "RAM marker write + counter read (agent file API)",
            &lp.probes,
        ),
        ("activity step (guest exec)", &lp.activity_ms),
        ("workspace checksum (guest exec)", &lp.checksum_ms),
    ] {
        lat.latency_row(name, &samples.summary(), vec![]);
    }
    lat
}
