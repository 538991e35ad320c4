//! Section `restore`: the three ways strata brings a sandbox back — fork of a
//! snapshot, wake from hibernation, rewind in place — against a cold boot of
//! the same image, each to the point a user can use the sandbox.
//!
//! Method: one runtime on its own pool, one template of `--restore-mem` MiB
//! (its build is the first cold boot), one source sandbox with state (a
//! marker file with a random token, 16 MiB of written data). Fork, wake and
//! rewind are interleaved run by run (so drift of a shared machine hits them
//! alike); cold boots are spread among them. Every path is timed from the
//! runtime call to the first `exec true` answered by the guest agent; the
//! runtime's own `ready_ms` (call to agent synced) is kept beside it. Every
//! few runs the marker is read back after the restore: a restore that lost
//! the state fails the section instead of being measured.

use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::json;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_proto::client::ExecRequest;
use strata_runtime::{Runtime, Source};

use crate::ctx::{BenchRuntime, Ctx};
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, fmt_ratio, Samples};

/// Flags of the `restore` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "restore-args")]
pub struct Args {
    /// Runs of each restore path (fork, wake, rewind).
    #[arg(long = "restore-runs", id = "restore_runs", default_value_t = 50)]
    pub runs: usize,
    /// Cold boots of the image to agent-ready (each ~5 s under TCG, plus the
    /// template build around it): raise it for a tighter cold-boot tail.
    #[arg(
        long = "restore-cold-runs",
        id = "restore_cold_runs",
        default_value_t = 10
    )]
    pub cold_runs: usize,
    /// Guest memory of the template and sandboxes, MiB.
    #[arg(long = "restore-mem", id = "restore_mem", default_value_t = 512)]
    pub mem_mib: u32,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.runs = 3;
        self.cold_runs = 1;
    }
}

/// The runs (0-based, of `runs`) after which a cold boot is measured, so
/// that `cold` of them (the template build counts as the first) are spread
/// evenly among the restore runs.
fn cold_slots(runs: usize, cold: usize) -> Vec<usize> {
    let extra = cold.saturating_sub(1);
    if extra == 0 || runs == 0 {
        return Vec::new();
    }
    (1..=extra)
        .map(|k| (k * runs / (extra + 1)).min(runs - 1))
        .collect()
}

/// Whether run `i` reads its marker back (the first, the last, every 5th).
fn checks(i: usize, runs: usize) -> bool {
    i == 0 || i + 1 == runs || i.is_multiple_of(5)
}

async fn sh(rt: &Runtime, id: &SandboxId, script: &str) -> Result<String> {
    let agent = rt
        .agent(id)
        .await
        .with_context(|| format!("agent of {id}"))?;
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .with_context(|| format!("exec {script:?} in {id}"))?;
    if !out.status.success() {
        bail!(
            "{script:?} in {id} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// First `exec true` answered; ms since `t0`.
async fn first_exec(rt: &Runtime, id: &SandboxId, t0: Instant) -> Result<f64> {
    sh(rt, id, "true").await?;
    Ok(t0.elapsed().as_secs_f64() * 1000.0)
}

async fn expect_marker(rt: &Runtime, id: &SandboxId, want: &str, what: &str) -> Result<()> {
    let got = sh(rt, id, "cat /root/marker").await?;
    if got != want {
        bail!("{what}: /root/marker is {got:?}, expected {want:?}: the restore lost the state");
    }
    Ok(())
}

/// Raw samples of one path.
#[derive(Default)]
struct Path {
    /// Call to first exec answered, ms.
    total: Samples,
    /// The runtime's `ready_ms`.
    ready: Samples,
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let size = SandboxSize {
        memory_mib: args.mem_mib,
        ..SandboxSize::default()
    };
    sec.text(format!(
        "**Method.** One strata runtime on its own btrfs pool; a template of {} MiB / {} vCPU; a source sandbox \
         made from it holding state (a marker file with a random token and 16 MiB written). Each path is timed \
         from the runtime call to the first `exec true` answered by the guest agent — what a user waits for:\n\n\
         - **fork**: `create` of a new sandbox from a snapshot of the source (writable btrfs snapshot + device-state restore + agent sync); the fork is deleted afterwards (untimed);\n\
         - **wake**: the source is hibernated (untimed: snapshot, VM ends), then `wake`;\n\
         - **rewind**: the source (marker overwritten) is returned in place to its snapshot, without a pre-rewind snapshot (the daemon takes one by default: add one snapshot pause, section 1);\n\
         - **cold boot**: the same image booted from scratch by a template build, QEMU start to the guest agent's first answer. \
           This favours the cold boot: it leaves out the file copies and the first `exec` round trip that the other paths include.\n\n\
         The three restore paths run interleaved, {} times each; the {} cold boots (each ~5 s under TCG plus its template build; \
         `--restore-cold-runs` raises the count) are spread among them. The marker is read back after a restore on every 5th run: \
         a restore that loses state fails the section. Accelerator: {}.",
        size.memory_mib, size.vcpus, args.runs, args.cold_runs.max(1), ctx.accel
    ));
    let env = BenchRuntime::start(ctx, "strata-bench-restore-", 24, |_| {}).await?;
    let rt = env.rt.clone();
    eprintln!(
        "restore: building the template ({} MiB, cold boot)",
        size.memory_mib
    );
    let (tpl, boot_ms) = env.template(size).await?;
    let mut cold = Samples::new();
    cold.push(boot_ms);
    eprintln!("restore: cold boot {boot_ms:.0} ms");

    let src = SandboxId::generate();
    rt.create(&src, &Source::Template(tpl.clone()), None)
        .await
        .context("create the source sandbox")?;
    let token = format!("{:016x}", rand::random::<u64>());
    sh(
        &rt,
        &src,
        &format!(
            "echo {token} > /root/marker && dd if=/dev/urandom of=/root/state bs=1M count=16 2>/dev/null && sync"
        ),
    )
    .await?;
    let base = SnapshotId::generate();
    rt.snapshot(&src, &base)
        .await
        .context("snapshot the source")?;

    let (mut fork, mut wake, mut rewind) = (Path::default(), Path::default(), Path::default());
    let mut hibernate = Samples::new();
    let mut checked = 0usize;
    let slots = cold_slots(args.runs, args.cold_runs);
    let t_all = Instant::now();
    for i in 0..args.runs {
        let check = checks(i, args.runs);
        // Fork.
        let id = SandboxId::generate();
        let t0 = Instant::now();
        let vm = rt
            .create(&id, &Source::Snapshot(base.clone()), None)
            .await
            .with_context(|| format!("fork run {i}"))?;
        fork.total.push(first_exec(&rt, &id, t0).await?);
        fork.ready.push(vm.ready_ms);
        if check {
            expect_marker(&rt, &id, &token, "fork").await?;
        }
        rt.delete(&id).await.context("delete the fork")?;

        // Wake.
        let h = SnapshotId::generate();
        let th = Instant::now();
        rt.hibernate(&src, &h)
            .await
            .with_context(|| format!("hibernate run {i}"))?;
        hibernate.push_dur(th.elapsed());
        let t0 = Instant::now();
        let vm = rt
            .wake(&src, &h)
            .await
            .with_context(|| format!("wake run {i}"))?;
        wake.total.push(first_exec(&rt, &src, t0).await?);
        wake.ready.push(vm.ready_ms);
        if check {
            expect_marker(&rt, &src, &token, "wake").await?;
        }
        rt.delete_snapshot(&h)
            .await
            .context("delete the hibernation snapshot")?;

        // Rewind.
        if check {
            sh(&rt, &src, "echo overwritten > /root/marker").await?;
        }
        let t0 = Instant::now();
        let (_, vm) = rt
            .rewind(&src, &base, None)
            .await
            .with_context(|| format!("rewind run {i}"))?;
        rewind.total.push(first_exec(&rt, &src, t0).await?);
        rewind.ready.push(vm.ready_ms);
        if check {
            expect_marker(&rt, &src, &token, "rewind").await?;
            checked += 1;
        }

        for _ in slots.iter().filter(|s| **s == i) {
            let t = TemplateId::generate();
            let built = rt
                .build_template(&t, size, &|_| {})
                .await
                .context("cold boot (template build)")?;
            cold.push(built.boot_ms);
            rt.delete_template(&t)
                .await
                .context("delete the template")?;
        }
        eprintln!(
            "restore: run {}/{}: fork {:.0} ms, wake {:.0} ms, rewind {:.0} ms ({} cold boots, {:.0} s)",
            i + 1,
            args.runs,
            fork.total.0.last().copied().unwrap_or(f64::NAN),
            wake.total.0.last().copied().unwrap_or(f64::NAN),
            rewind.total.0.last().copied().unwrap_or(f64::NAN),
            cold.len(),
            t_all.elapsed().as_secs_f64()
        );
    }
    rt.delete(&src).await.context("delete the source")?;
    if fork.total.is_empty() {
        return Err(anyhow!("no restore runs (--restore-runs 0)"));
    }

    let cs = cold.summary();
    let mut t = Table::latency(
        "Restore to first exec answered, vs a cold boot of the same image",
        &["runtime ready p50", "speed-up vs cold boot (p50)"],
    );
    let mut rows = Vec::new();
    for (name, p) in [("fork", &fork), ("wake", &wake), ("rewind", &rewind)] {
        let s = p.total.summary();
        t.latency_row(
            name,
            &s,
            vec![fmt_ms(p.ready.summary().p50), fmt_ratio(cs.p50, s.p50)],
        );
        rows.push((name, s));
    }
    t.latency_row(
        "cold boot (QEMU start to agent)",
        &cs,
        vec!["–".into(), "1×".into()],
    );
    sec.table(t);
    let hs = hibernate.summary();
    sec.text(format!(
        "Correctness: the marker was read back after fork, wake and rewind on {checked} runs each, all intact. \
         Hibernating the source before each wake (untimed above) took p50 {}, p99 {} (n={}).",
        fmt_ms(hs.p50),
        fmt_ms(hs.p99),
        hs.n
    ));

    let file = "restore-cdf.svg";
    plot::cdf(
        &ctx.file(file),
        "Restore paths vs cold boot: time to a usable sandbox",
        "ms",
        &[
            ("fork".into(), fork.total.0.clone()),
            ("wake".into(), wake.total.0.clone()),
            ("rewind".into(), rewind.total.0.clone()),
            ("cold boot".into(), cold.0.clone()),
        ],
    )?;
    sec.plot(
        file,
        "CDF of time to first exec answered: fork, wake and rewind against a cold boot (log x when they differ by > 20×)",
    );
    let parts: Vec<String> = rows
        .iter()
        .map(|(n, s)| {
            format!(
                "{n} p50 {} / p99 {} ({} faster than a cold boot at p50)",
                fmt_ms(s.p50),
                fmt_ms(s.p99),
                fmt_ratio(cs.p50, s.p50)
            )
        })
        .collect();
    sec.headline(format!(
        "to first exec answered: {}; cold boot p50 {} (n={}, {})",
        parts.join("; "),
        fmt_ms(cs.p50),
        cs.n,
        ctx.accel
    ));
    sec.data = json!({
        "params": { "runs": args.runs, "cold_runs": cold.len(), "memory_mib": size.memory_mib, "vcpus": size.vcpus, "accel": ctx.accel.to_string() },
        "fork_ms": fork.total.0, "fork_ready_ms": fork.ready.0,
        "wake_ms": wake.total.0, "wake_ready_ms": wake.ready.0,
        "rewind_ms": rewind.total.0, "rewind_ready_ms": rewind.ready.0,
        "cold_boot_ms": cold.0,
        "hibernate_ms": hibernate.0,
        "summary": {
            "fork": fork.total.summary(), "wake": wake.total.summary(),
            "rewind": rewind.total.summary(), "cold_boot": cs,
        },
        "checked_runs": checked,
    });
    drop(env);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cold_boots_spread_over_the_runs() {
        assert!(cold_slots(3, 1).is_empty());
        assert!(cold_slots(0, 5).is_empty());
        assert_eq!(cold_slots(50, 15).len(), 14);
        let s = cold_slots(50, 15);
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        assert!(s.iter().all(|i| *i < 50));
        // More cold boots than runs: several after the same run.
        assert_eq!(cold_slots(2, 4), vec![0, 1, 1]);
    }

    #[test]
    fn marker_checks_cover_first_and_last() {
        let c: Vec<usize> = (0..12).filter(|i| checks(*i, 12)).collect();
        assert_eq!(c, vec![0, 5, 10, 11]);
        assert!(checks(0, 1));
    }
}
