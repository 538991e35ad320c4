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
//!
//! With `--restore-ab` (the default) fork and wake run twice per run,
//! "before" and "after" in alternating order: before = the runtime with
//! `Runtime::set_hello_on_port_open(false)` (Hello on the client's timed
//! 40 ms resend only), after = the default (Hello also cued by QMP
//! `VSERPORT_CHANGE`). Each start's `Runtime::start_timeline` gives a
//! breakdown table (state check, btrfs clone, QEMU spawn, QMP, device
//! state, `cont`, socket, Hello → `hello_ok`, session, `restore_sync`,
//! first exec). Results: `docs/bench/first-exec.md`. Measured there
//! (2-core TCG host shared with other builds, 100 runs): `VSERPORT_CHANGE`
//! arrives while `cont` is still being answered, before the first Hello,
//! so the cue alone changes nothing (fork p99 3.67 s → 3.67 s); the time
//! goes to the guest running cold after a restore (Hello → `hello_ok`
//! p50 ~300 ms, `restore_sync` and the first exec each as long).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::json;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_proto::client::ExecRequest;
use strata_runtime::{Runtime, Source, StartTimeline};

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
    /// Also measure fork and wake "before" (the agent handshake without the
    /// QMP `VSERPORT_CHANGE` cue, Hello only on its timed resend) beside
    /// "after" (the default), interleaved in the same run.
    #[arg(
        long = "restore-ab",
        id = "restore_ab",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub ab: bool,
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

/// The start's steps, in the order they end: (name, from, to) over the
/// marks of a [`StartTimeline`] plus the first exec (`exec_ms`, the call's
/// ms to first exec answered, measured here).
const STEPS: &[&str] = &[
    "check the state (meta, QEMU compatibility)",
    "btrfs snapshot of the state",
    "meta.json + signature check",
    "QEMU spawn (fork + exec)",
    "QMP socket + handshake",
    "console + watchers",
    "device state load (migrate-incoming)",
    "cont",
    "cont → agent socket connected",
    "connected → hello_ok (Hello, resends)",
    "session: output window + egress",
    "restore_sync (entropy, clock, identity)",
    "start returns",
    "first exec `true` (request → reply)",
];

/// The duration of each of [`STEPS`] in one start.
fn step_durations(tl: &StartTimeline, exec_ms: f64) -> Vec<f64> {
    let incoming = tl.incoming_ms.unwrap_or(tl.assembled_ms);
    let running = tl.running_ms.unwrap_or(incoming);
    let marks = [
        0.0,
        tl.opened_ms,
        tl.cloned_ms,
        tl.vm_called_ms,
        tl.spawned_ms,
        tl.qmp_ms,
        tl.assembled_ms,
        incoming,
        running,
        tl.connected_ms,
        tl.hello_ok_ms,
        tl.session_ms,
        tl.synced_ms,
        tl.ready_ms,
        exec_ms,
    ];
    marks.windows(2).map(|w| w[1] - w[0]).collect()
}

/// Samples of one path in one variant: the call to first exec, the
/// runtime's `ready_ms`, and the start's timelines.
#[derive(Default)]
struct Variant {
    total: Samples,
    ready: Samples,
    steps: Vec<Samples>,
    /// cont → QMP `VSERPORT_CHANGE` (the guest's port reported open).
    port_open: Samples,
    hellos: Vec<u32>,
    cued: Vec<u32>,
    /// The host's part: the call until the vCPUs run (`cont` answered).
    host: Samples,
    /// The guest's part: vCPUs running until the first exec is answered
    /// (Hello, restore sync, session, the exec).
    guest: Samples,
    /// A second `exec true` right after the first, in the same guest: the
    /// same request once the guest's code paths have run (under TCG: are
    /// translated).
    warm_exec: Samples,
}

impl Variant {
    fn push(&mut self, total: f64, ready: f64, tl: Option<StartTimeline>) {
        self.total.push(total);
        self.ready.push(ready);
        let Some(tl) = tl else { return };
        let running = tl.running_ms.or(tl.incoming_ms).unwrap_or(tl.assembled_ms);
        self.host.push(running);
        self.guest.push(total - running);
        let d = step_durations(&tl, total);
        if self.steps.is_empty() {
            self.steps = vec![Samples::new(); d.len()];
        }
        for (s, v) in self.steps.iter_mut().zip(d) {
            s.push(v);
        }
        if let (Some(p), Some(r)) = (tl.port_open_ms, tl.running_ms) {
            self.port_open.push(p - r);
        }
        self.hellos.push(tl.hellos);
        self.cued.push(tl.hellos_cued);
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "total_ms": self.total.0, "ready_ms": self.ready.0,
            "steps_ms": STEPS.iter().zip(&self.steps).map(|(n, s)| json!({"step": n, "ms": s.0})).collect::<Vec<_>>(),
            "port_open_after_cont_ms": self.port_open.0,
            "hellos": self.hellos, "hellos_cued": self.cued,
            "host_ms": self.host.0, "guest_ms": self.guest.0, "warm_exec_ms": self.warm_exec.0,
            "summary": self.total.summary(),
        })
    }
}

/// Forks `base` into a new sandbox, to first exec; deletes the fork.
async fn fork_once(
    rt: &Arc<Runtime>,
    base: &SnapshotId,
    check: Option<&str>,
    run: usize,
    into: &mut Variant,
) -> Result<()> {
    let id = SandboxId::generate();
    let t0 = Instant::now();
    let vm = rt
        .create(&id, &Source::Snapshot(base.clone()), None)
        .await
        .with_context(|| format!("fork run {run}"))?;
    let total = first_exec(rt, &id, t0).await?;
    into.push(total, vm.ready_ms, rt.start_timeline(&id));
    into.warm_exec
        .push(first_exec(rt, &id, Instant::now()).await?);
    if let Some(token) = check {
        expect_marker(rt, &id, token, "fork").await?;
    }
    rt.delete(&id).await.context("delete the fork")?;
    Ok(())
}

/// Hibernates `src` (untimed but for `hibernate`), wakes it, to first exec.
async fn wake_once(
    rt: &Arc<Runtime>,
    src: &SandboxId,
    check: Option<&str>,
    run: usize,
    hibernate: &mut Samples,
    into: &mut Variant,
) -> Result<()> {
    let h = SnapshotId::generate();
    let th = Instant::now();
    rt.hibernate(src, &h)
        .await
        .with_context(|| format!("hibernate run {run}"))?;
    hibernate.push_dur(th.elapsed());
    let t0 = Instant::now();
    let vm = rt
        .wake(src, &h)
        .await
        .with_context(|| format!("wake run {run}"))?;
    let total = first_exec(rt, src, t0).await?;
    into.push(total, vm.ready_ms, rt.start_timeline(src));
    into.warm_exec
        .push(first_exec(rt, src, Instant::now()).await?);
    if let Some(token) = check {
        expect_marker(rt, src, token, "wake").await?;
    }
    rt.delete_snapshot(&h)
        .await
        .context("delete the hibernation snapshot")?;
    Ok(())
}

/// Which of a [`Variant`]'s samples a row shows.
type Pick = fn(&Variant) -> &Samples;

/// The before → after table of fork and wake, and the breakdown of where
/// each step's time goes.
fn ab_tables(sec: &mut Section, paths: &[(&str, &Variant, &Variant)]) {
    let mut t = Table::latency(
        "Fork and wake to first exec answered: before (Hello on the timed resend only) → after (Hello also cued by QMP VSERPORT_CHANGE), same run, interleaved",
        &["p99 after ÷ before", "Hellos per start (mean)", "cued Hellos (mean)"],
    );
    for (name, before, after) in paths {
        for (label, v) in [("before", before), ("after", after)] {
            let s = v.total.summary();
            let mean = |x: &[u32]| {
                if x.is_empty() {
                    f64::NAN
                } else {
                    x.iter().map(|v| f64::from(*v)).sum::<f64>() / x.len() as f64
                }
            };
            let ratio = if label == "after" {
                format!("{:.2}", s.p99 / before.total.summary().p99)
            } else {
                "–".into()
            };
            t.latency_row(
                format!("{name} {label}"),
                &s,
                vec![
                    ratio,
                    format!("{:.2}", mean(&v.hellos)),
                    format!("{:.2}", mean(&v.cued)),
                ],
            );
        }
    }
    sec.table(t);
    let mut headers = vec!["step".to_string()];
    for (name, _, _) in paths {
        for label in ["before", "after"] {
            headers.push(format!("{name} {label} p50 / p99"));
        }
    }
    let hs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut b = Table::new(
        "Where the time to first exec goes: each step's duration (the steps end one after the other; p50 / p99 over the runs)",
        &hs,
    );
    let cell = |s: &Samples| {
        let x = s.summary();
        format!("{} / {}", fmt_ms(x.p50), fmt_ms(x.p99))
    };
    for (k, step) in STEPS.iter().enumerate() {
        let mut row = vec![step.to_string()];
        for (_, before, after) in paths {
            for v in [before, after] {
                row.push(v.steps.get(k).map(cell).unwrap_or_else(|| "–".into()));
            }
        }
        b.row(row);
    }
    let mut row = vec!["(beside) cont → QMP VSERPORT_CHANGE open".to_string()];
    for (_, before, after) in paths {
        for v in [before, after] {
            row.push(cell(&v.port_open));
        }
    }
    b.row(row);
    let mut row = vec!["total: call → first exec answered".to_string()];
    for (_, before, after) in paths {
        for v in [before, after] {
            row.push(cell(&v.total));
        }
    }
    b.row(row);
    let split: [(&str, Pick); 3] = [
        (
            "host's part: call → vCPUs running (`cont` answered)",
            |v| &v.host,
        ),
        ("guest's part: vCPUs running → first exec answered", |v| {
            &v.guest
        }),
        ("(beside) a second exec `true` right after the first", |v| {
            &v.warm_exec
        }),
    ];
    for (name, pick) in split {
        let mut row = vec![name.to_string()];
        for (_, before, after) in paths {
            for v in [before, after] {
                row.push(cell(pick(v)));
            }
        }
        b.row(row);
    }
    sec.table(b);
}

async fn expect_marker(rt: &Runtime, id: &SandboxId, want: &str, what: &str) -> Result<()> {
    let got = sh(rt, id, "cat /root/marker").await?;
    if got != want {
        bail!("{what}: /root/marker is {got:?}, expected {want:?}: the restore lost the state");
    }
    Ok(())
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

    let (mut fork, mut wake, mut rewind) =
        (Variant::default(), Variant::default(), Variant::default());
    let (mut fork_before, mut wake_before) = (Variant::default(), Variant::default());
    let mut hibernate = Samples::new();
    let mut checked = 0usize;
    let slots = cold_slots(args.runs, args.cold_runs);
    let t_all = Instant::now();
    for i in 0..args.runs {
        let check = checks(i, args.runs);
        // Fork and wake; with `--restore-ab` each twice, without the Hello
        // cue ("before") and with it ("after"), in alternating order.
        let token_check = check.then_some(token.as_str());
        let order: &[bool] = match (args.ab, i % 2 == 0) {
            (false, _) => &[true],
            (true, true) => &[false, true],
            (true, false) => &[true, false],
        };
        for &cue in order {
            rt.set_hello_on_port_open(cue);
            let into = if cue { &mut fork } else { &mut fork_before };
            fork_once(&rt, &base, token_check, i, into).await?;
        }
        for &cue in order {
            rt.set_hello_on_port_open(cue);
            let into = if cue { &mut wake } else { &mut wake_before };
            wake_once(&rt, &src, token_check, i, &mut hibernate, into).await?;
        }
        rt.set_hello_on_port_open(true);

        // Rewind.
        if check {
            sh(&rt, &src, "echo overwritten > /root/marker").await?;
        }
        let t0 = Instant::now();
        let (_, vm) = rt
            .rewind(&src, &base, None)
            .await
            .with_context(|| format!("rewind run {i}"))?;
        let total = first_exec(&rt, &src, t0).await?;
        rewind.push(total, vm.ready_ms, rt.start_timeline(&src));
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
    if args.ab {
        ab_tables(
            sec,
            &[("fork", &fork_before, &fork), ("wake", &wake_before, &wake)],
        );
    }
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
        "ab": args.ab.then(|| json!({
            "fork_before": fork_before.json(), "fork_after": fork.json(),
            "wake_before": wake_before.json(), "wake_after": wake.json(),
            "rewind": rewind.json(),
        })),
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
