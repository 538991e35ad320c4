//! Section `load`: tail latency under load, and what the rolling snapshot
//! schedule does to it.
//!
//! A real stratad ([`BenchDaemon`]: the real runtime, SQLite, HTTP on
//! loopback) runs `--load-sandboxes` sandboxes created from its default
//! template. `--load-clients` closed-loop clients each pick a random sandbox
//! and a random operation per `--load-mix` (exec `true` / PUT a 64 KiB file /
//! POST a manual snapshot) for `--load-secs` seconds, twice: (a) with no
//! rolling schedule, (b) with every sandbox's rolling snapshot interval set to
//! `--load-interval` seconds. Every operation is recorded (phase, op, start,
//! latency, ok or the failure); the rolling snapshots of phase (b) are read
//! back from the store (their vCPU pause and when it happened).

mod phases;
mod report;
mod timeline;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use strata_core::SandboxSize;

use crate::ctx::{BenchDaemon, Ctx};
use crate::report::Section;
use crate::stats::{fmt_ms, fmt_num, Summary};

use phases::{create_sandboxes, op_exec, rolling_snapshots, run_phase, set_interval};
use report::{ops_table, report_all, Bounds};

/// Flags of the `load` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "load-args")]
pub struct Args {
    /// Sandboxes under load (1 vCPU each).
    #[arg(long, default_value_t = 20)]
    pub load_sandboxes: usize,
    /// Concurrent closed-loop clients.
    #[arg(long, default_value_t = 50)]
    pub load_clients: usize,
    /// Length of each phase (baseline, rolling), seconds.
    #[arg(long, default_value_t = 45)]
    pub load_secs: u64,
    /// Rolling snapshot interval of every sandbox in phase (b), seconds.
    #[arg(long, default_value_t = 10)]
    pub load_interval: u64,
    /// Guest memory of each sandbox, MiB.
    #[arg(long, default_value_t = 256)]
    pub load_mem: u64,
    /// Operation mix in percent: exec, file write, manual snapshot.
    #[arg(long, default_value = "80,15,5", value_parser = parse_mix)]
    pub load_mix: Mix,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.load_sandboxes = 2;
        self.load_clients = 4;
        self.load_secs = 8;
        self.load_interval = 2;
    }
}

/// Percent of operations that are exec, file write and manual snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Mix {
    /// `exec true`.
    pub exec: u32,
    /// PUT of a 64 KiB file.
    pub write: u32,
    /// POST of a manual snapshot.
    pub snapshot: u32,
}

impl Mix {
    /// The operation a uniform roll in `0..100` stands for.
    fn pick(&self, roll: u32) -> Op {
        if roll < self.exec {
            Op::Exec
        } else if roll < self.exec + self.write {
            Op::Write
        } else {
            Op::Snapshot
        }
    }
}

/// Parses `exec,write,snapshot` percentages summing to 100.
fn parse_mix(s: &str) -> Result<Mix, String> {
    let v: Vec<u32> = s
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [exec, write, snapshot] if exec + write + snapshot == 100 => Ok(Mix {
            exec,
            write,
            snapshot,
        }),
        [_, _, _] => Err(format!("the mix {s:?} does not sum to 100")),
        _ => Err(format!(
            "expected three percentages exec,write,snapshot, got {s:?}"
        )),
    }
}

/// One kind of client operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    Exec,
    Write,
    Snapshot,
}

impl Op {
    const ALL: [Op; 3] = [Op::Exec, Op::Write, Op::Snapshot];

    fn name(self) -> &'static str {
        match self {
            Op::Exec => "exec `true`",
            Op::Write => "file write 64 KiB",
            Op::Snapshot => "manual snapshot",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Op::Exec => "exec",
            Op::Write => "write",
            Op::Snapshot => "snapshot",
        }
    }
}

const PHASES: [&str; 2] = ["baseline", "rolling"];
const FILE_BYTES: usize = 64 * 1024;
/// Width of the timeline's windows, seconds.
const WINDOW_S: f64 = 2.0;

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let n = args.load_sandboxes.max(1);
    let mix = args.load_mix;
    sec.text(format!(
        "A real stratad (real runtime, SQLite store, HTTP API on loopback) runs {n} sandboxes \
         (1 vCPU, {} MiB, QEMU microvm under {}) created from its default template. {} \
         closed-loop clients each pick a random sandbox and an operation ({}% `exec true`, {}% PUT of \
         a 64 KiB file, {}% POST of a manual snapshot) and time it from sending the request to \
         the end of the answer: for exec, the NDJSON stream up to its exit line (exit 0 required); \
         for the file write the `201`; for the snapshot the `201` with the snapshot record. Phase (a), \
         baseline: {} s with no rolling schedule. Phase (b), rolling: every sandbox's rolling \
         snapshot interval set to {} s (recorded in the store, then rescheduled: the API sets it \
         only at create) and the same clients for {} s. Every failure is counted per operation \
         (HTTP status, transport error or non-zero exit), never dropped; percentiles are over the \
         successful operations. The daemon's per-token rate limit (by default 50 requests/s, burst \
         100, and all clients share the admin token) is raised to 100000/s so that it does not \
         shape the load; the measured request rates are printed below the table. Before the \
         phases, one client alone runs `exec true` {} times round-robin over the sandboxes: the \
         unloaded reference. The rolling snapshots' vCPU pauses and times come from the store's \
         snapshot records.",
        args.load_mem,
        ctx.accel,
        args.load_clients,
        mix.exec,
        mix.write,
        mix.snapshot,
        args.load_secs,
        args.load_interval,
        args.load_secs,
        idle_runs(ctx),
    ));
    let cpus = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    sec.text(format!(
        "Host: {cpus} CPUs for {n} guests (one QEMU each, {} emulated), {} clients, the daemon and \
         this harness, all competing: latencies measure a saturated host, not a quiet one.",
        ctx.accel, args.load_clients
    ));
    let mut data = json!({
        "params": {
            "sandboxes": n, "clients": args.load_clients, "secs": args.load_secs,
            "interval_s": args.load_interval, "mem_mib": args.load_mem, "mix": mix,
            "file_bytes": FILE_BYTES, "window_s": WINDOW_S,
            "rate_limit_per_second": 100000.0, "accel": ctx.accel.to_string(),
        }
    });
    sec.data = data.clone();

    let size = SandboxSize {
        vcpus: 1,
        memory_mib: args.load_mem as u32,
        disk_gib: 2,
    };
    eprintln!("load: starting stratad and building its default template (cold boot)...");
    let t = Instant::now();
    let d = BenchDaemon::start(ctx, "strata-bench-load-", 16, size, |cfg| {
        // `n` 1-vCPU sandboxes whatever the host's CPU count.
        cfg.capacity.vcpus = n as u32;
        // `App::stop` leaves the exit watcher running: with auto-recovery on,
        // the teardown's kill of the VMs would have them restored (and leaked).
        cfg.auto_recover = false;
        cfg.security.rate_limit_per_second = 100_000.0;
        cfg.security.rate_limit_burst = 100_000;
    })
    .await?;
    let template_s = t.elapsed().as_secs_f64();
    eprintln!("load: template ready in {template_s:.1} s; creating {n} sandboxes...");

    // Created two at a time: each is a restore of the template's snapshot.
    let t = Instant::now();
    let (ids, create_ms) = create_sandboxes(&d.http, n).await?;
    let setup_s = t.elapsed().as_secs_f64();
    let cs = Summary::of(&create_ms);
    eprintln!("load: {n} sandboxes running in {setup_s:.1} s");
    sec.text(format!(
        "Setup: default template built in {template_s:.1} s; {n} sandboxes created and answering \
         in {setup_s:.1} s (create p50 {}, max {}, two at a time).",
        fmt_ms(cs.p50),
        fmt_ms(cs.max)
    ));
    data["setup"] = json!({ "template_s": template_s, "create_ms": create_ms, "setup_s": setup_s });
    sec.data = data.clone();
    let intro_blocks = sec.blocks.len();
    let ids = Arc::new(ids);

    // The unloaded reference: one client, one exec at a time.
    let mut idle = Vec::new();
    for i in 0..idle_runs(ctx) {
        let id = &ids[i % ids.len()];
        let t = Instant::now();
        op_exec(&d.http, id)
            .await
            .map_err(|f| anyhow!("unloaded exec: {}", f.msg))?;
        idle.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    data["idle_exec_ms"] = json!(idle);
    sec.data = data.clone();

    let load_before = loadavg();
    let svc = d.app.service().clone();
    let t0 = Instant::now();
    let t0_utc = svc.now();
    let since_t0 = |at: DateTime<Utc>| (at - t0_utc).num_milliseconds() as f64 / 1000.0;

    eprintln!(
        "load: phase (a) baseline: {} clients for {} s...",
        args.load_clients, args.load_secs
    );
    let a = run_phase(&d.http, &ids, args, 0, t0).await?;
    let a_end = t0.elapsed().as_secs_f64();
    sec.table(ops_table(args, &idle, &[&a]));
    data["records"] = json!(a.recs);
    sec.data = data.clone();

    set_interval(&d, &ids, args.load_interval).await?;
    let b_start_utc = svc.now();
    let b_start = since_t0(b_start_utc);
    eprintln!(
        "load: phase (b) rolling every {} s: {} clients for {} s...",
        args.load_interval, args.load_clients, args.load_secs
    );
    let b = run_phase(&d.http, &ids, args, 1, t0).await?;
    let b_end_utc = svc.now();
    let b_end = since_t0(b_end_utc);
    set_interval(&d, &ids, 0).await?;
    // Let a snapshot already under way finish before reading the records.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let rolling = rolling_snapshots(&d, &ids, b_start_utc, b_end_utc, t0_utc).await?;

    sec.blocks.truncate(intro_blocks);
    let bounds = Bounds {
        a_end,
        b_start,
        b_end,
    };
    let stats = svc.metrics().stats();
    let daemon_pause = stats.steps.get("snapshot_pause");
    report_all(
        sec,
        ctx,
        args,
        &idle,
        &a,
        &b,
        &rolling,
        &bounds,
        daemon_pause,
    )?;
    let load_after = loadavg();
    sec.text(format!(
        "Host load average (1 min) when phase (a) started: {}; when phase (b) ended: {} \
         (everything on the machine counts, including other work running beside this benchmark).",
        load_before.map(fmt_num).unwrap_or_else(|| "unknown".into()),
        load_after.map(fmt_num).unwrap_or_else(|| "unknown".into()),
    ));
    data["loadavg"] = json!({ "before": load_before, "after": load_after });
    let expected = (b_end - b_start).max(0.0) / args.load_interval.max(1) as f64 * n as f64;
    if (rolling.len() as f64) < 0.9 * expected {
        sec.text(format!(
            "The schedule asked for about {expected:.0} rolling snapshots in phase (b) and {} were \
             taken: the daemon runs at most {} scheduled snapshots at once and a slot that comes due \
             while the scheduler waits for a free one is not made up for, and a \
             scheduled snapshot that finds its sandbox busy with another operation (here, a \
             manual snapshot) is skipped; with pauses this long the schedule fell behind.",
            rolling.len(),
            svc.config().max_concurrent_tasks
        ));
    }
    let mut all = a.recs.clone();
    all.extend(b.recs.iter().cloned());
    data["records"] = json!(all);
    data["rolling_snapshots"] = json!(rolling);
    data["phase_bounds_s"] = json!({ "a": [0.0, a_end], "b": [b_start, b_end] });
    data["first_errors"] = json!({
        "baseline": a.first_err.iter().map(|(k, v)| (k.key(), v.clone())).collect::<BTreeMap<_, _>>(),
        "rolling": b.first_err.iter().map(|(k, v)| (k.key(), v.clone())).collect::<BTreeMap<_, _>>(),
    });
    if let Some(s) = daemon_pause {
        data["daemon_snapshot_pause_all_kinds"] = json!(s);
    }
    sec.data = data;
    d.stop();
    Ok(())
}

/// The host's 1-minute load average.
fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Execs of the unloaded reference (one client, one at a time).
fn idle_runs(ctx: &Ctx) -> usize {
    if ctx.smoke {
        5
    } else {
        40
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_parses_and_picks() {
        let m = parse_mix("80,15,5").expect("mix");
        assert_eq!(
            m,
            Mix {
                exec: 80,
                write: 15,
                snapshot: 5
            }
        );
        assert_eq!(m.pick(0), Op::Exec);
        assert_eq!(m.pick(79), Op::Exec);
        assert_eq!(m.pick(80), Op::Write);
        assert_eq!(m.pick(94), Op::Write);
        assert_eq!(m.pick(95), Op::Snapshot);
        assert_eq!(m.pick(99), Op::Snapshot);
        assert!(parse_mix("80,15").is_err());
        assert!(parse_mix("80,15,6").is_err());
        assert!(parse_mix("a,b,c").is_err());
        let only = parse_mix("100, 0, 0").expect("mix");
        assert!((0..100).all(|r| only.pick(r) == Op::Exec));
    }
}
