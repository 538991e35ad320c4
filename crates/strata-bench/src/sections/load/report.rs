//! The `load` section's write-up once both phases are measured: the op ×
//! phase table, the execs split by whether a rolling snapshot paused their
//! sandbox, the snapshots' pauses, the first failures, the plots and the
//! headlines.

use std::collections::BTreeMap;

use anyhow::Result;

use super::phases::{PhaseOut, Rec, Rolling};
use super::timeline::timeline;
use super::{Args, Op, PHASES, WINDOW_S};
use crate::ctx::Ctx;
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, fmt_num, fmt_ratio, percentile, Summary};

/// Where the phases lie, seconds since phase (a)'s start.
pub(super) struct Bounds {
    pub(super) a_end: f64,
    pub(super) b_start: f64,
    pub(super) b_end: f64,
}

/// Successful latencies of `op` in `p`.
fn ok_ms(p: &PhaseOut, op: Op) -> Vec<f64> {
    p.recs
        .iter()
        .filter(|r| r.op == op && r.err.is_none())
        .map(|r| r.ms)
        .collect()
}

/// The op × phase table: n, percentiles, errors, throughput and, on the
/// rolling rows, the p99 ratio rolling / baseline.
pub(super) fn ops_table(args: &Args, idle: &[f64], phases: &[&PhaseOut]) -> Table {
    let mut t = Table::latency(
        format!(
            "Client-side latency per operation and phase ({} clients, {} sandboxes, {} s per phase; successful operations)",
            args.load_clients, args.load_sandboxes, args.load_secs
        ),
        &["errors", "ops/s", "p99 rolling / baseline"],
    );
    t.latency_row(
        "exec `true` — unloaded reference (one client)",
        &Summary::of(idle),
        vec!["0".into(), String::new(), String::new()],
    );
    for op in Op::ALL {
        let base_p99 = phases
            .first()
            .map(|p| Summary::of(&ok_ms(p, op)).p99)
            .unwrap_or(f64::NAN);
        for (i, p) in phases.iter().enumerate() {
            let s = Summary::of(&ok_ms(p, op));
            let recs: Vec<&Rec> = p.recs.iter().filter(|r| r.op == op).collect();
            let ratio = if i == 0 {
                String::new()
            } else {
                fmt_ratio(s.p99, base_p99)
            };
            t.latency_row(
                format!("{} — {}", op.name(), PHASES[i]),
                &s,
                vec![
                    error_cell(&recs),
                    fmt_num(s.n as f64 / args.load_secs.max(1) as f64),
                    ratio,
                ],
            );
        }
    }
    t
}

/// Most events whose times fall in any window of `width` (times ascending).
fn most_in_window(times: &[f64], width: f64) -> usize {
    let mut most = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= width {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

/// `(window mid, p50, p99)` of the latencies in consecutive windows of
/// `width` seconds over `[from, to)`; windows without samples are left out.
fn windows(samples: &[(f64, f64)], from: f64, to: f64, width: f64) -> Vec<(f64, f64, f64)> {
    let mut out = Vec::new();
    let mut w0 = from;
    while w0 < to {
        let mut v: Vec<f64> = samples
            .iter()
            .filter(|(t, _)| *t >= w0 && *t < w0 + width)
            .map(|(_, ms)| *ms)
            .collect();
        if !v.is_empty() {
            v.sort_by(f64::total_cmp);
            out.push((w0 + width / 2.0, percentile(&v, 50.0), percentile(&v, 99.0)));
        }
        w0 += width;
    }
    out
}

/// Whether `[a0, a1]` and `[b0, b1]` overlap.
fn overlaps(a0: f64, a1: f64, b0: f64, b1: f64) -> bool {
    a0 <= b1 && b0 <= a1
}

/// `n (k×class, …)` of failures, `0` when none.
fn error_cell(recs: &[&Rec]) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for r in recs {
        if let Some(e) = &r.err {
            *by.entry(e.as_str()).or_default() += 1;
        }
    }
    let n: usize = by.values().sum();
    if n == 0 {
        return "0".into();
    }
    let parts: Vec<String> = by.iter().map(|(k, v)| format!("{v}× {k}")).collect();
    format!("{n} ({})", parts.join(", "))
}

/// The request rate each phase put on the daemon, against its default limit.
fn rate_note(args: &Args, phases: &[&PhaseOut]) -> String {
    let secs = args.load_secs.max(1) as f64;
    let rates: Vec<String> = phases
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "{} {} requests/s",
                PHASES[i],
                fmt_num(p.recs.len() as f64 / secs)
            )
        })
        .collect();
    format!(
        "Request rate on the daemon (all operations, one shared token): {}; the default \
         per-token limit is 50/s with a burst of 100.",
        rates.join(", ")
    )
}

/// Writes the whole section once both phases are measured.
#[allow(clippy::too_many_arguments)]
pub(super) fn report_all(
    sec: &mut Section,
    ctx: &Ctx,
    args: &Args,
    idle: &[f64],
    a: &PhaseOut,
    b: &PhaseOut,
    rolling: &[Rolling],
    bounds: &Bounds,
    daemon_pause: Option<&stratad::metrics::Summary>,
) -> Result<()> {
    sec.table(ops_table(args, idle, &[a, b]));
    sec.text(rate_note(args, &[a, b]));

    // Execs of phase (b) that overlapped a rolling snapshot's pause of their own sandbox.
    let n = args.load_sandboxes.max(1);
    let mut hit = Vec::new();
    let mut clear = Vec::new();
    for r in b
        .recs
        .iter()
        .filter(|r| r.op == Op::Exec && r.err.is_none())
    {
        let end = r.start_s + r.ms / 1000.0;
        let touched = rolling.iter().any(|s| {
            s.sandbox == r.sandbox
                && overlaps(
                    r.start_s,
                    end,
                    s.at_s,
                    s.at_s + s.pause_ms.unwrap_or(0.0) / 1000.0,
                )
        });
        if touched {
            hit.push(r.ms);
        } else {
            clear.push(r.ms);
        }
    }
    let base_exec = Summary::of(&ok_ms(a, Op::Exec));
    let mut t = Table::latency(
        "Phase (b) execs split by whether a rolling snapshot paused their own sandbox while they ran",
        &["p99 / baseline p99"],
    );
    let hs = Summary::of(&hit);
    let cs = Summary::of(&clear);
    t.latency_row(
        "exec overlapping its sandbox's rolling snapshot pause",
        &hs,
        vec![fmt_ratio(hs.p99, base_exec.p99)],
    );
    t.latency_row(
        "exec with no rolling snapshot of its sandbox meanwhile",
        &cs,
        vec![fmt_ratio(cs.p99, base_exec.p99)],
    );
    sec.table(t);

    // The rolling snapshots themselves.
    let pauses: Vec<f64> = rolling.iter().filter_map(|s| s.pause_ms).collect();
    let span = (bounds.b_end - bounds.b_start).max(0.0);
    let expected = span / args.load_interval.max(1) as f64 * n as f64;
    let times: Vec<f64> = rolling.iter().map(|s| s.at_s).collect();
    let most = most_in_window(&times, 1.0);
    let mut t = Table::latency("vCPU pause of the snapshots", &["notes"]);
    let ps = Summary::of(&pauses);
    t.latency_row(
        "rolling, phase (b) (store `pause_ms`)",
        &ps,
        vec![format!(
            "{} taken in {:.0} s (schedule: ~{:.0}); {} without pause_ms; at most {most} started in any 1 s",
            rolling.len(),
            span,
            expected,
            rolling.len() - pauses.len()
        )],
    );
    for (i, p) in [a, b].iter().enumerate() {
        let m: Vec<f64> = p
            .recs
            .iter()
            .filter(|r| r.op == Op::Snapshot)
            .filter_map(|r| r.pause_ms)
            .collect();
        t.latency_row(
            format!("manual, phase ({}) (API answer `pause_ms`)", ["a", "b"][i]),
            &Summary::of(&m),
            vec![String::new()],
        );
    }
    if let Some(s) = daemon_pause {
        t.row(vec![
            "daemon `snapshot_pause` histogram, whole run, all kinds".into(),
            s.count.to_string(),
            fmt_ms(s.p50_ms),
            fmt_ms(s.p95_ms),
            fmt_ms(s.p99_ms),
            fmt_ms(s.max_ms),
            "cross-check (HDR histogram)".into(),
        ]);
    }
    sec.table(t);

    let errs: Vec<String> = [a, b]
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            p.first_err
                .iter()
                .map(move |(op, m)| format!("- {} / {}: `{}`", PHASES[i], op.key(), m))
        })
        .collect();
    if !errs.is_empty() {
        sec.text(format!(
            "First failure of each kind (all failures are counted in the table):\n\n{}",
            errs.join("\n")
        ));
    }

    // Plots.
    let exec_pts = |p: &PhaseOut| -> Vec<(f64, f64)> {
        p.recs
            .iter()
            .filter(|r| r.op == Op::Exec && r.err.is_none())
            .map(|r| (r.start_s, r.ms))
            .collect()
    };
    let wa = windows(&exec_pts(a), 0.0, bounds.a_end, WINDOW_S);
    let wb = windows(&exec_pts(b), bounds.b_start, bounds.b_end, WINDOW_S);
    let stems: Vec<(f64, f64)> = rolling
        .iter()
        .filter_map(|s| s.pause_ms.map(|p| (s.at_s, p)))
        .collect();
    let file = "load-timeline.svg";
    timeline(&ctx.file(file), &wa, &wb, &stems, bounds)?;
    sec.plot(
        file,
        format!(
            "Exec `true` latency over time, p50 and p99 per {WINDOW_S:.0} s window: baseline, then \
             with every sandbox snapshotted every {} s (shaded); each rolling snapshot is a \
             vertical stem as tall as its vCPU pause",
            args.load_interval
        ),
    );
    let file = "load-cdf.svg";
    plot::cdf(
        &ctx.file(file),
        "exec `true` under load: baseline vs rolling snapshots",
        "ms",
        &[
            ("baseline".into(), ok_ms(a, Op::Exec)),
            ("rolling snapshots on".into(), ok_ms(b, Op::Exec)),
        ],
    )?;
    sec.plot(
        file,
        "CDF of exec `true` latency (client side, through the API) in both phases",
    );

    // Headlines.
    let be = Summary::of(&ok_ms(b, Op::Exec));
    let errors = |p: &PhaseOut| p.recs.iter().filter(|r| r.err.is_some()).count();
    let total = |p: &PhaseOut| p.recs.len();
    sec.headline(format!(
        "{} clients on {n} sandboxes ({} CPUs, {}): exec `true` p50/p99 {} / {} baseline (n={}) vs \
         {} / {} with every sandbox snapshotted every {} s (n={}): p99 ratio {} ({}; unloaded \
         exec p50 {})",
        args.load_clients,
        std::thread::available_parallelism()
            .map(|c| c.get())
            .unwrap_or(1),
        ctx.accel,
        fmt_ms(base_exec.p50),
        fmt_ms(base_exec.p99),
        base_exec.n,
        fmt_ms(be.p50),
        fmt_ms(be.p99),
        args.load_interval,
        be.n,
        fmt_ratio(be.p99, base_exec.p99),
        if be.p99 > base_exec.p99 * 1.5 {
            "target missed: the schedule spikes exec p99 by more than 1.5×"
        } else {
            "target met: no exec p99 spike above 1.5×"
        },
        fmt_ms(Summary::of(idle).p50),
    ));
    sec.headline(format!(
        "Rolling snapshot vCPU pause p50/p99 {} / {} (n={}, {:.0} expected); operations failed: {} of {} baseline, {} of {} rolling",
        fmt_ms(ps.p50),
        fmt_ms(ps.p99),
        ps.n,
        expected,
        errors(a),
        total(a),
        errors(b),
        total(b)
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_spread() {
        let s = [(0.1, 1.0), (0.5, 3.0), (1.9, 2.0), (2.5, 10.0), (5.0, 4.0)];
        let w = windows(&s, 0.0, 6.0, 2.0);
        assert_eq!(w, vec![(1.0, 2.0, 3.0), (3.0, 10.0, 10.0), (5.0, 4.0, 4.0)]);
        assert_eq!(most_in_window(&[0.0, 0.5, 0.9, 1.0, 3.0], 1.0), 3);
        assert_eq!(most_in_window(&[], 1.0), 0);
        assert!(overlaps(0.0, 1.0, 1.0, 2.0));
        assert!(!overlaps(0.0, 1.0, 1.1, 2.0));
    }

    #[test]
    fn errors_are_counted_by_class() {
        let rec = |err: Option<&str>| Rec {
            phase: 0,
            op: Op::Exec,
            sandbox: 0,
            start_s: 0.0,
            ms: 1.0,
            err: err.map(str::to_owned),
            pause_ms: None,
        };
        let v = [
            rec(None),
            rec(Some("429")),
            rec(Some("429")),
            rec(Some("409")),
        ];
        let refs: Vec<&Rec> = v.iter().collect();
        assert_eq!(error_cell(&refs), "3 (1× 409, 2× 429)");
        assert_eq!(error_cell(&refs[..1]), "0");
    }
}
