//! Section `history`: a week of history, compressed.
//!
//! One sandbox runs an agent workload (git clone of a local repository, wheel
//! installs from a local folder, edits and commits, build outputs, a
//! long-running process whose counter lives in RAM) while it is snapshotted
//! on a virtual clock: each step of the loop stands for `--history-every`
//! virtual minutes, takes a real strata snapshot stamped with that virtual
//! time, and runs the daemon's own retention code
//! (`stratad::retention::RetentionPolicy::to_delete`) at that virtual "now",
//! deleting for real what it selects. Measured: the pool bytes used over
//! virtual time against what the guest really wrote to its disk, the
//! snapshot pause during the loop, and rewinds to random surviving snapshots
//! checked by checksums of the workspace and of RAM state.
//!
//! The parts: `plan` (the steps on the virtual clock, retention, pure
//! functions), `guest` (the sandbox and the workload set up in it),
//! `snapshot_loop` (the loop), `report` (the bytes at the end, the
//! tables and the plot), `rewinds` (the verified rewinds and the week
//! estimate), `workload` (what the agent does).

mod guest;
mod plan;
mod report;
mod rewinds;
mod snapshot_loop;
mod workload;

use anyhow::{bail, Result};
use chrono::{DateTime, Utc};
use serde_json::json;
use strata_core::SnapshotId;

use crate::ctx::Ctx;
use crate::report::Section;
use crate::stats::fmt_bytes;

use plan::{describe, Plan};

/// Flags of the `history` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "history-args")]
pub struct Args {
    /// Virtual days of history to run.
    #[arg(long = "history-days", default_value_t = 7.0)]
    pub history_days: f64,
    /// Virtual minutes between two snapshots (the daemon's rolling interval).
    /// The default week takes one every 20 virtual minutes (504 snapshots, about
    /// 2.5 minutes here); `--history-every 1` is the full 1/min week (10,080
    /// snapshots, an estimated 25–45 minutes on 2 cores, not run yet).
    #[arg(long = "history-every", default_value_t = 20)]
    pub history_every: u64,
    /// Retention tiers `WITHIN:EVERY,…` (e.g. `1h:0,24h:10m,7d:1h`) [default: the daemon's].
    #[arg(long = "history-retention")]
    pub history_retention: Option<String>,
    /// Guest memory of the sandbox, MiB.
    #[arg(long = "history-mem", default_value_t = 512)]
    pub history_mem: u32,
    /// Rewinds to random surviving snapshots, each verified.
    #[arg(long = "history-rewinds", default_value_t = 5)]
    pub history_rewinds: usize,
    /// Seed of the rewind choice [default: random, printed].
    #[arg(long = "history-seed")]
    pub history_seed: Option<u64>,
    /// Virtual minutes between two bursts of agent activity (3 steps each;
    /// default: two working sessions a day).
    #[arg(long = "history-burst-every", default_value_t = 720)]
    pub history_burst_every: u64,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        // 70 one-minute snapshots: past the first tier, so retention deletes;
        // one burst of 3 activity steps (clone, install, edit + commit).
        self.history_days = 70.0 / 1440.0;
        self.history_every = 1;
        self.history_rewinds = 1;
        self.history_burst_every = 1440;
    }
}

/// One taken snapshot (kept or deleted later).
#[derive(Debug, Clone)]
struct Snap {
    id: SnapshotId,
    /// Loop step (the snapshot's number; also written to the guest's RAM marker).
    step: u64,
    /// Virtual time it stands for.
    at: DateTime<Utc>,
    /// Index of the workspace state (activity step) it holds.
    state: usize,
    /// Counter read before the snapshot and after it.
    counter_lo: u64,
    counter_hi: u64,
}

/// The workspace after one activity step.
#[derive(Debug, Clone, serde::Serialize)]
struct State {
    step: u64,
    label: &'static str,
    minute: u64,
    checksum: String,
    activity_ms: f64,
    checksum_ms: f64,
    disk_written: u64,
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let plan = Plan::new(args)?;
    let (every, steps, burst_every, seed) = (plan.every, plan.steps, plan.burst_every, plan.seed);
    eprintln!(
        "history: {steps} snapshots, one per {every} virtual minute(s) = {:.2} virtual days; retention {}; rewind seed {seed}",
        plan.days(),
        describe(&plan.policy)
    );
    sec.data = json!({
        "params": {
            "steps": steps, "every_minutes": every, "days": args.history_days,
            "retention": plan.policy, "memory_mib": args.history_mem, "rewinds": args.history_rewinds,
            "seed": seed, "burst_every_minutes": burst_every,
        }
    });
    let g = guest::setup(ctx, args).await?;
    sec.text(method(args, &plan, &g));
    let looped = snapshot_loop::run(&plan, &g).await?;
    report::write(ctx, args, &plan, &g, &looped, sec).await?;
    let failures = rewinds::run(args, &plan, &g, &looped, sec).await?;
    let _ = g.rt.delete(&g.id).await;
    g.env.stop();
    if !failures.is_empty() {
        bail!(
            "{} rewind(s) did not restore the recorded state: {}",
            failures.len(),
            failures.join(", ")
        );
    }
    Ok(())
}

/// The method and the workload, as the report states them.
fn method(args: &Args, plan: &Plan, g: &guest::Guest) -> String {
    let (every, steps, burst_every) = (plan.every, plan.steps, plan.burst_every);
    let repo_files = g.repo_files;
    format!(
        "**Method.** One sandbox ({} MiB, 1 vCPU, 2 GiB disk) runs an agent workload while it is snapshotted on a \
         *virtual clock*: each loop step stands for {every} virtual minute(s), takes a real strata snapshot \
         (`Runtime::snapshot`: pause, device state, btrfs snapshot, resume) stamped with that virtual time, then runs \
         the daemon's own retention code (`stratad::retention::RetentionPolicy::to_delete`) with the virtual time as \
         \"now\" and really deletes (`Runtime::delete_snapshot`) every snapshot it selects. So {steps} snapshots \
         ({:.2} virtual days) are taken back to back instead of one a minute: the time is compressed, the snapshots, \
         deletions and bytes are real. Retention tiers: {}.\n\n\
         **Workload.** Prepared on the host: a git repository of {repo_files} source files plus later additions in {} commits \
         (host `git`, uploaded as a tar through the agent's file API) and a folder of {} small pure-Python wheels \
         ({} in all: zip files with `<name>.dist-info/{{METADATA,WHEEL,RECORD}}`, written by the harness). The image \
         has python3 but no pip, so wheels are installed by a 30-line installer that does what pip does for a pure \
         wheel (checks every file against RECORD's sha256, removes the other installed version, extracts into \
         site-packages, writes INSTALLER, byte-compiles). Every {burst_every} virtual minutes the agent works in a \
         burst of 3 steps (one per virtual minute) cycling through: `git clone` of the local repo, wheel install, \
         edits + `git commit`, a build (1–3 MiB of output + a tar of the sources, older outputs removed), a wheel \
         upgrade/downgrade, edits + commit + `git gc`. A long-running process (started once) keeps a counter in memory \
         and writes it to a tmpfs (RAM) every second. After each activity step the workspace checksum is recorded \
         (sha256 over the sorted sha256 of every file under `/work` and the site-packages); before each snapshot the \
         harness writes the snapshot's step number into a tmpfs file (a RAM marker), and reads the counter after it. \
         Guest disk writes are the guest kernel's sectors written to its disk (`/sys/block/vda/stat`), read after \
         each activity step; pool bytes are the btrfs pool's used bytes (statfs) after each step.",
        args.history_mem,
        plan.days(),
        describe(&plan.policy),
        g.commits,
        g.wheels,
        fmt_bytes(g.wheel_bytes as f64),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The section at smoke size, without the CLI (`--ignored`: needs root,
    /// QEMU and a guest image). Output in `/tmp/bench-history-test`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root, QEMU and a built guest image"]
    async fn smoke_run() {
        let image = stratad::daemon::newest_image(&strata_image::default_cache_dir())
            .expect("a guest image");
        let out = std::path::PathBuf::from("/tmp/bench-history-test");
        std::fs::create_dir_all(&out).expect("out dir");
        let ctx = Ctx {
            out: out.clone(),
            image,
            accel: strata_core::Accel::Tcg,
            qemu: "qemu-system-x86_64".into(),
            smoke: std::env::var_os("HISTORY_FULL").is_none(),
        };
        let mut args = Args {
            history_days: 1.0 / 3.0,
            history_every: 1,
            history_retention: None,
            history_mem: 512,
            history_rewinds: 5,
            history_seed: Some(1),
            history_burst_every: 120,
        };
        if ctx.smoke {
            args.smoke();
        }
        let mut sec = Section::new("history", "history");
        let res = run(&ctx, &args, &mut sec).await;
        crate::ctx::teardown_all();
        std::fs::write(
            out.join("section.json"),
            serde_json::to_vec_pretty(&sec).expect("json"),
        )
        .expect("write");
        res.expect("section");
    }
}
