//! Section `chaos` (opt-in: `strata-bench --only chaos`; 100 kills, about an
//! hour): `strata_testkit::chaos` — a real `stratad` process with real
//! guests, concurrent clients doing every operation (create from the
//! template, exec, marker writes, snapshot, fork, rewind, hibernate/wake,
//! pause/resume, sandbox policies, delete) and `kill -9` at random moments
//! of the daemon (restarted on the same directories), of one QEMU, of one
//! guest's agent. After each kill every invariant is checked against what
//! the daemon acknowledged and against the host's own tables; at the end
//! every acknowledged snapshot is restored. `--smoke` does a few kills.
//! See `docs/bench/chaos.md`.

use std::time::Duration;

use anyhow::{anyhow, Result};
use serde_json::json;
use strata_testkit::chaos::{self, ChaosConfig};

use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, percentile};

/// Flags of the `chaos` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "chaos-args")]
pub struct Args {
    /// Kills (daemon, QEMU and agent together).
    #[arg(id = "chaos-kills", long = "chaos-kills", default_value_t = 100)]
    pub kills: usize,
    /// Concurrent clients.
    #[arg(id = "chaos-clients", long = "chaos-clients", default_value_t = 3)]
    pub clients: usize,
    /// Most acknowledged live sandboxes at once.
    #[arg(id = "chaos-sandboxes", long = "chaos-sandboxes", default_value_t = 6)]
    pub sandboxes: usize,
    /// Shortest seconds between a check's end and the next kill.
    #[arg(id = "chaos-gap-min", long = "chaos-gap-min", default_value_t = 10)]
    pub gap_min: u64,
    /// Longest seconds between a check's end and the next kill.
    #[arg(id = "chaos-gap-max", long = "chaos-gap-max", default_value_t = 30)]
    pub gap_max: u64,
    /// Acknowledged snapshots restored after each kill.
    #[arg(id = "chaos-sample", long = "chaos-sample", default_value_t = 3)]
    pub sample: usize,
    /// Seed [default: $STRATA_CHAOS_SEED, else from the clock].
    #[arg(id = "chaos-seed", long = "chaos-seed")]
    pub seed: Option<u64>,
}

impl Args {
    /// A few kills, short gaps.
    pub fn smoke(&mut self) {
        self.kills = self.kills.min(4);
        self.clients = self.clients.min(2);
        self.sandboxes = self.sandboxes.min(4);
        self.gap_min = self.gap_min.min(3);
        self.gap_max = self.gap_max.min(6);
        self.sample = self.sample.min(2);
    }
}

/// Runs the section.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let seed = args.seed.unwrap_or_else(chaos::seed_from_env);
    let mut cfg = ChaosConfig::new(ctx.image.clone(), seed);
    cfg.kills = args.kills;
    cfg.clients = args.clients;
    cfg.max_sandboxes = args.sandboxes;
    cfg.gap = (
        Duration::from_secs(args.gap_min),
        Duration::from_secs(args.gap_max.max(args.gap_min)),
    );
    cfg.sample = args.sample;
    cfg.accel = ctx.accel.to_string();
    let r = chaos::run(cfg).await.map_err(|e| anyhow!(e))?;
    eprintln!("{}", r.summary());

    let all = r.recovery_ms(None);
    let mut t = Table::new(
        format!("chaos, seed {seed} (replay: --chaos-seed {seed})"),
        &["figure", "value"],
    );
    let row = |t: &mut Table, k: &str, v: String| t.row(vec![k.to_owned(), v]);
    row(
        &mut t,
        "kills done (daemon / QEMU / agent)",
        format!(
            "{} ({} / {} / {})",
            r.kills(),
            r.daemon_kills,
            r.qemu_kills,
            r.agent_kills
        ),
    );
    row(
        &mut t,
        "operations acknowledged",
        r.acked_total().to_string(),
    );
    row(&mut t, "invariant checks run", r.checks.to_string());
    row(
        &mut t,
        "violations (must be 0)",
        r.violations.len().to_string(),
    );
    row(&mut t, "restores checked", r.restores_checked.to_string());
    for kind in [None, Some("daemon"), Some("qemu"), Some("agent")] {
        let v = r.recovery_ms(kind);
        if v.is_empty() {
            continue;
        }
        row(
            &mut t,
            &format!(
                "recovery after a {} kill p50 / p99 (n={})",
                kind.unwrap_or("any"),
                v.len()
            ),
            format!(
                "{} / {}",
                fmt_ms(percentile(&v, 50.0)),
                fmt_ms(percentile(&v, 99.0))
            ),
        );
    }
    row(
        &mut t,
        "wall time",
        format!("{:.0} s", r.wall.as_secs_f64()),
    );
    sec.table(t);
    let mut ops = Table::new(
        "operations by kind",
        &["operation", "acknowledged", "not acknowledged"],
    );
    let kinds: std::collections::BTreeSet<&String> =
        r.acked.keys().chain(r.unanswered.keys()).collect();
    for k in kinds {
        ops.row(vec![
            k.clone(),
            r.acked.get(k).copied().unwrap_or(0).to_string(),
            r.unanswered.get(k).copied().unwrap_or(0).to_string(),
        ]);
    }
    sec.table(ops);
    sec.headline(format!(
        "{} kills, {} operations acknowledged, {} checks, {} violations, recovery p50 {} p99 {}, {} restores checked",
        r.kills(),
        r.acked_total(),
        r.checks,
        r.violations.len(),
        fmt_ms(percentile(&all, 50.0)),
        fmt_ms(percentile(&all, 99.0)),
        r.restores_checked
    ));
    sec.data = json!({
        "seed": seed,
        "kills": { "daemon": r.daemon_kills, "qemu": r.qemu_kills, "agent": r.agent_kills },
        "acked": r.acked,
        "unanswered": r.unanswered,
        "checks": r.checks,
        "violations": r.violations,
        "restores_checked": r.restores_checked,
        "recovery_ms": all,
    });
    if !r.violations.is_empty() {
        sec.text(format!("daemon log tail:\n\n```\n{}\n```", r.log_tail));
        return Err(anyhow!("violations: {}", r.violations.join("; ")));
    }
    Ok(())
}
