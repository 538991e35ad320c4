//! Section `snapshot`: the pause of a strata snapshot (device state only +
//! btrfs CoW of RAM and disk) side by side, same guest size, same run, with
//! the two things a QEMU user does otherwise: a full-memory save to a file
//! (`virsh save`: migrate all of RAM) and a QEMU internal snapshot of RAM +
//! disk in qcow2 (`savevm`, what `virsh snapshot-create` does), idle and with a
//! writer dirtying memory, plus the physical floor: the bytes the snapshot had
//! to write ÷ the pool's write bandwidth, both measured in the same run.

mod measure;
mod peer;

/// A progress line on stderr, with the wall-clock time.
macro_rules! progress {
    ($($t:tt)*) => {
        eprintln!("[{}] snapshot: {}", chrono::Utc::now().format("%H:%M:%S"), format!($($t)*))
    };
}

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use serde::Serialize;
use strata_core::{SandboxId, SandboxSize};
use strata_runtime::Source;

use crate::ctx::{BenchRuntime, Ctx};
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_num, fmt_ratio, percentile, Summary};

use measure::{full_save, strata_snapshots, writeback_bandwidth};
use peer::{sh, vmstate_bytes, PeerVm};

/// Flags of the `snapshot` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "snapshot-args")]
pub struct Args {
    /// Guest RAM sizes to measure, MiB (comma-separated).
    #[arg(
        id = "snapshot-sizes",
        long = "snapshot-sizes",
        value_delimiter = ',',
        default_value = "256,1024,2048"
    )]
    pub sizes: Vec<u64>,
    /// strata snapshots per case (size × workload).
    #[arg(id = "snapshot-runs", long = "snapshot-runs", default_value_t = 15)]
    pub runs: usize,
    /// Full-memory saves and savevms per case (at most: see --snapshot-peer-budget-s).
    #[arg(
        id = "snapshot-peer-runs",
        long = "snapshot-peer-runs",
        default_value_t = 5
    )]
    pub peer_runs: usize,
    /// Time budget of each alternative per case, seconds: its runs stop once they
    /// took this long (at least 2 runs). Full saves of 2 GiB take seconds each.
    #[arg(
        id = "snapshot-peer-budget-s",
        long = "snapshot-peer-budget-s",
        default_value_t = 8.0
    )]
    pub peer_budget_s: f64,
    /// MiB/s the writer dirties (a working set of that many MiB, every page once per second, spread over the second); 0 = idle only.
    #[arg(
        id = "snapshot-write-rate",
        long = "snapshot-write-rate",
        default_value_t = 64
    )]
    pub write_rate: u64,
    /// Gap between consecutive snapshots (and saves), ms.
    #[arg(
        id = "snapshot-interval-ms",
        long = "snapshot-interval-ms",
        default_value_t = 500
    )]
    pub interval_ms: u64,
    /// Share of guest RAM filled with random data (then freed) before measuring, percent.
    #[arg(
        id = "snapshot-fill-percent",
        long = "snapshot-fill-percent",
        default_value_t = 25
    )]
    pub fill_percent: u64,
    /// MiB written (fsync timed) per sample of the pool's writeback bandwidth.
    #[arg(
        id = "snapshot-bandwidth-mib",
        long = "snapshot-bandwidth-mib",
        default_value_t = 256
    )]
    pub bandwidth_mib: u64,
    /// Samples of the pool's writeback bandwidth per guest size (the median is used).
    #[arg(
        id = "snapshot-bandwidth-runs",
        long = "snapshot-bandwidth-runs",
        default_value_t = 3
    )]
    pub bandwidth_runs: usize,
    /// strata snapshots per arm of the device-state A/B (before: a
    /// migration, `migrate fd:` with `x-ignore-shared`; now: the direct
    /// save, `xen-save-devices-state` completed by the driver), interleaved
    /// on the same VM after each case's own runs; 0 = skip.
    /// (`--snapshot-events-ab` is the old name.)
    #[arg(
        id = "snapshot-save-ab",
        long = "snapshot-save-ab",
        alias = "snapshot-events-ab",
        default_value_t = 15
    )]
    pub save_ab: usize,
    /// What the device-state A/B compares: `memory` (before: the direct
    /// save into the sandbox's `.device.state.tmp` in the pool, beside the
    /// btrfs snapshot of that pool; now: the direct save into a memfd,
    /// written to the pool after `cont`), `migrate` (before: a
    /// migration; now: the direct save) or `copies` (before: the btrfs
    /// snapshot under the pause; now: reflink copies under the pause, the
    /// btrfs snapshot after `cont`: `Runtime::set_copies_in_pause`) or
    /// `into-snapshot` (before: copies in the subvolume's `.pause/`, the
    /// snapshot after `cont`; now: the snapshot before the pause, its files
    /// caught up in it: `Runtime::set_copies_into_snapshot`).
    #[arg(
        id = "snapshot-ab-kind",
        long = "snapshot-ab-kind",
        default_value = "memory",
        value_parser = ["memory", "migrate", "copies", "into-snapshot"]
    )]
    pub ab_kind: String,
}

impl Args {
    /// The A/B's two arms, as named in tables.
    fn ab_names(&self) -> (&'static str, &'static str) {
        if self.ab_kind == "migrate" {
            ("migrate", "direct")
        } else if self.ab_kind == "copies" {
            ("btrfs snapshot in the pause", "copies in the pause")
        } else if self.ab_kind == "into-snapshot" {
            ("copies in .pause/", "copies into the snapshot")
        } else {
            ("direct to a pool file", "direct into memory")
        }
    }

    /// Sets the A/B's arm (`now`: the newer one) process-wide.
    fn ab_arm(&self, rt: &strata_runtime::Runtime, now: bool) {
        if self.ab_kind == "copies" {
            rt.set_copies_in_pause(now);
        } else if self.ab_kind == "into-snapshot" {
            rt.set_copies_into_snapshot(now);
        } else if self.ab_kind == "migrate" {
            strata_vmm::qemu::set_direct_save(now);
        } else {
            strata_vmm::qemu::set_save_in_memory(now);
        }
    }

    /// Back to the defaults after an A/B snapshot.
    fn ab_reset(&self, rt: &strata_runtime::Runtime) {
        rt.set_copies_in_pause(true);
        rt.set_copies_into_snapshot(true);
        strata_vmm::qemu::set_direct_save(true);
        strata_vmm::qemu::set_save_in_memory(true);
    }
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.sizes = vec![256];
        self.runs = 3;
        self.peer_runs = 1;
        self.bandwidth_mib = 64;
        self.bandwidth_runs = 2;
        self.save_ab = self.save_ab.min(2);
    }
}

/// The three methods and the floor, as named in tables and plots.
const STRATA: &str = "strata";
const FULL: &str = "full save";
const SAVEVM: &str = "savevm";
const FLOOR: &str = "floor";

/// Everything measured for one guest size under one workload.
#[derive(Debug, Default, Clone, Serialize)]
struct Case {
    size_mib: u64,
    /// `idle` or `writer`.
    workload: String,
    strata_ms: Vec<f64>,
    /// Bytes each strata snapshot had to write (RAM + disk rewritten since the
    /// previous one, plus device state).
    dirtied_bytes: Vec<f64>,
    /// `dirtied_bytes` ÷ pool write bandwidth, ms.
    floor_ms: Vec<f64>,
    /// Extent walk per strata snapshot (outside the pause), ms.
    walk_ms: Vec<f64>,
    /// Where each strata pause went.
    phases: Vec<strata_runtime::PausePhases>,
    /// The A/B of how device state is saved, interleaved: pauses and
    /// device-state steps with a migration ...
    ab_before: Vec<strata_runtime::PausePhases>,
    ab_before_ms: Vec<f64>,
    /// ... and with the direct save (the default).
    ab_now: Vec<strata_runtime::PausePhases>,
    ab_now_ms: Vec<f64>,
    full_save_ms: Vec<f64>,
    full_save_bytes: Vec<f64>,
    savevm_ms: Vec<f64>,
    /// `vm-state-size` of each internal snapshot (`qemu-img info`).
    savevm_vmstate_bytes: Vec<f64>,
}

impl Case {
    fn label(&self) -> String {
        format!("{} {}", size_label(self.size_mib), self.workload)
    }

    /// p50 of a method's pauses (NaN when not measured).
    fn p50(&self, method: &str) -> f64 {
        Summary::of(self.samples(method)).p50
    }

    fn samples(&self, method: &str) -> &[f64] {
        match method {
            STRATA => &self.strata_ms,
            FULL => &self.full_save_ms,
            SAVEVM => &self.savevm_ms,
            _ => &self.floor_ms,
        }
    }

    fn written(&self, method: &str) -> &[f64] {
        match method {
            STRATA => &self.dirtied_bytes,
            FULL => &self.full_save_bytes,
            SAVEVM => &self.savevm_vmstate_bytes,
            _ => &self.dirtied_bytes,
        }
    }
}

/// Pool write bandwidth measured for one guest size.
#[derive(Debug, Default, Clone, Serialize)]
struct Bandwidth {
    size_mib: u64,
    /// Samples, bytes/s.
    samples: Vec<f64>,
    /// Their median, bytes/s.
    median: f64,
}

#[derive(Debug, Default, Serialize)]
struct Results {
    bandwidth: Vec<Bandwidth>,
    cases: Vec<Case>,
    /// Template cold boot per size, ms (not a figure of this section).
    template_boot_ms: Vec<(u64, f64)>,
    /// QEMU's run state right after a savevm (checked once per size).
    peer_status_after_savevm: Vec<(u64, String)>,
}

/// A table cell `p50 (p99)` of `s`.
fn p50_p99(s: &Summary) -> String {
    format!("{} ({})", fmt_num(s.p50), fmt_num(s.p99))
}

/// Summary of the device-state step of `phases`.
fn device_state(phases: &[strata_runtime::PausePhases]) -> Summary {
    Summary::of(&phases.iter().map(|p| p.device_state_ms).collect::<Vec<_>>())
}

fn size_label(mib: u64) -> String {
    if mib >= 1024 && mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

/// Gap between consecutive full saves or savevms, ms.
const PEER_GAP_MS: u64 = 200;

/// Whether run `i` (0-based) of an alternative may start after `spent` of its
/// budget: the first two always do, later ones while under budget.
fn within_budget(i: usize, spent: Duration, budget_s: f64) -> bool {
    i < 2 || spent.as_secs_f64() < budget_s
}

/// `bytes` at `bytes_per_s`, in ms.
fn floor_ms(bytes: f64, bytes_per_s: f64) -> f64 {
    if bytes_per_s > 0.0 {
        bytes / bytes_per_s * 1000.0
    } else {
        f64::NAN
    }
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let mut res = Results::default();
    let measured = measure(ctx, args, &mut res).await;
    // Whatever was measured is reported, also after a failure part-way.
    render(ctx, args, &res, sec)?;
    measured
}

async fn measure(ctx: &Ctx, args: &Args, res: &mut Results) -> Result<()> {
    if args.sizes.is_empty() {
        return Err(anyhow!("--snapshot-sizes is empty"));
    }
    for &mib in &args.sizes {
        measure_size(ctx, args, mib, res)
            .await
            .with_context(|| format!("{} guest", size_label(mib)))?;
    }
    Ok(())
}

async fn measure_size(ctx: &Ctx, args: &Args, mib: u64, res: &mut Results) -> Result<()> {
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: u32::try_from(mib).context("guest size")?,
        disk_gib: 2,
    };
    // RAM file + a full save + the peer's qcow2 (disk + vmstate) + CoW room.
    let pool_gib = 8 + 4 * mib.div_ceil(1024);
    progress!("{} guest, pool {pool_gib} GiB", size_label(mib));
    // A 2 GiB guest under TCG on a loaded 2-core host can take over the
    // default 60 s to boot its template; a bound only, nothing measured.
    let brt = BenchRuntime::start(ctx, "stb-snap-", pool_gib, |cfg| {
        cfg.agent_timeout_ms = cfg.agent_timeout_ms.max(180_000)
    })
    .await?;
    let root = brt.rt.pool().root().to_path_buf();

    // The pool's write bandwidth, before any VM runs on it.
    let mut bw = Bandwidth {
        size_mib: mib,
        ..Bandwidth::default()
    };
    for _ in 0..args.bandwidth_runs.max(1) {
        let dir = root.clone();
        let bytes = args.bandwidth_mib.max(1) << 20;
        let v = tokio::task::spawn_blocking(move || writeback_bandwidth(&dir, bytes))
            .await
            .context("bandwidth task")??;
        bw.samples.push(v);
    }
    let mut sorted = bw.samples.clone();
    sorted.sort_by(f64::total_cmp);
    bw.median = percentile(&sorted, 50.0);
    let bw_median = bw.median;
    progress!(
        "pool write bandwidth {} MB/s (median of {})",
        fmt_num(bw_median / 1e6),
        bw.samples.len()
    );
    res.bandwidth.push(bw);

    // The strata template and the peer boot side by side (neither is timed here).
    let peer_dir = root.join("peer");
    std::fs::create_dir_all(&peer_dir).context("peer dir in the pool")?;
    let disk = peer_dir.join("disk.qcow2");
    progress!("building the template and booting the savevm peer");
    let (tpl, peer) = tokio::join!(brt.template(size), PeerVm::boot(ctx, mib, &disk));
    let peer = peer?;
    let (tpl, boot_ms) = tpl?;
    res.template_boot_ms.push((mib, boot_ms));
    let id = SandboxId::generate();
    brt.rt
        .create(&id, &Source::Template(tpl), None)
        .await
        .map_err(|e| anyhow!("create the sandbox: {e}"))?;
    let agent = brt.rt.agent(&id).await.map_err(|e| anyhow!("agent: {e}"))?;

    let fill = mib * args.fill_percent.min(90) / 100;
    if fill > 0 {
        progress!("filling {fill} MiB of each guest's RAM");
        let script = measure::fill_script(fill);
        let (a, b) = tokio::join!(sh(&agent, &script), peer.sh(&script));
        for (who, out) in [("strata guest", a?), ("peer guest", b?)] {
            if out != fill.to_string() {
                return Err(anyhow!("{who}: memory fill printed {out:?}"));
            }
        }
    }

    let interval = Duration::from_millis(args.interval_ms);
    let workloads: &[&str] = if args.write_rate > 0 {
        &["idle", "writer"]
    } else {
        &["idle"]
    };
    for &workload in workloads {
        if workload == "writer" {
            let script = measure::writer_start_script(args.write_rate);
            let (a, b) = tokio::join!(sh(&agent, &script), peer.sh(&script));
            for (who, out) in [("strata guest", a?), ("peer guest", b?)] {
                if out != "running" {
                    return Err(anyhow!("{who}: the writer did not start ({out:?})"));
                }
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        res.cases.push(Case {
            size_mib: mib,
            workload: workload.into(),
            ..Case::default()
        });
        let case = res.cases.last_mut().ok_or_else(|| anyhow!("no case"))?;
        let label = case.label();

        strata_snapshots(&brt.rt, &id, args.runs, interval, |s| {
            case.strata_ms.push(s.pause_ms);
            case.dirtied_bytes.push(s.dirtied_bytes as f64);
            case.floor_ms
                .push(floor_ms(s.dirtied_bytes as f64, bw_median));
            case.walk_ms.push(s.walk_ms);
            case.phases.push(s.phases);
        })
        .await
        .context("strata snapshots")?;
        progress!(
            "{label}: strata p50 {} (n={}), wrote {} p50, floor {}, extent walk {} p50",
            fmt_ms(case.p50(STRATA)),
            case.strata_ms.len(),
            fmt_bytes(Summary::of(&case.dirtied_bytes).p50),
            fmt_ms(case.p50(FLOOR)),
            fmt_ms(Summary::of(&case.walk_ms).p50),
        );

        // The A/B: the same VM, one snapshot at a time, alternating the
        // device-state save of before (a migration: `migrate fd:`, its
        // `MIGRATION` event, the wait until finalized) and of now (the
        // direct save), both beside the btrfs snapshot.
        for i in 0..args.save_ab * 2 {
            let now = i % 2 == 1;
            args.ab_arm(&brt.rt, now);
            let r = strata_snapshots(&brt.rt, &id, 1, interval, |s| {
                if now {
                    case.ab_now_ms.push(s.pause_ms);
                    case.ab_now.push(s.phases);
                } else {
                    case.ab_before_ms.push(s.pause_ms);
                    case.ab_before.push(s.phases);
                }
            })
            .await;
            args.ab_reset(&brt.rt);
            r.context("strata snapshots, device-state A/B")?;
        }
        if args.save_ab > 0 {
            let (before, now) = args.ab_names();
            progress!(
                "{label}: device state before ({before}) p50 {} vs now ({now}) p50 {}; pause {} vs {}",
                fmt_ms(device_state(&case.ab_before).p50),
                fmt_ms(device_state(&case.ab_now).p50),
                fmt_ms(Summary::of(&case.ab_before_ms).p50),
                fmt_ms(Summary::of(&case.ab_now_ms).p50),
            );
        }

        let state_file = root.join("full-save.state");
        let peer_gap = Duration::from_millis(PEER_GAP_MS);
        let t_full = Instant::now();
        for i in 0..args.peer_runs {
            if !within_budget(i, t_full.elapsed(), args.peer_budget_s) {
                break;
            }
            let (ms, bytes) = full_save(&brt.rt, &id, &state_file)
                .await
                .context("full-memory save")?;
            case.full_save_ms.push(ms);
            case.full_save_bytes.push(bytes as f64);
            tokio::time::sleep(peer_gap).await;
        }
        progress!(
            "{label}: full save p50 {} (n={}), wrote {}",
            fmt_ms(case.p50(FULL)),
            case.full_save_ms.len(),
            fmt_bytes(Summary::of(&case.full_save_bytes).p50),
        );

        let t_savevm = Instant::now();
        for i in 0..args.peer_runs {
            if !within_budget(i, t_savevm.elapsed(), args.peer_budget_s) {
                break;
            }
            let tag = format!("bench{i}");
            let ms = peer.savevm(&tag).await.context("savevm")?;
            // What it wrote: the RAM + device state recorded in the qcow2.
            let vmstate = vmstate_bytes(&peer.disk, &tag).await?;
            if i == 0 {
                let st = peer.status().await?;
                if st != "running" {
                    return Err(anyhow!("the peer is {st:?} after savevm, not running"));
                }
                res.peer_status_after_savevm.push((mib, st));
            }
            peer.delvm(&tag).await.context("delvm")?;
            case.savevm_ms.push(ms);
            case.savevm_vmstate_bytes.push(vmstate as f64);
            tokio::time::sleep(peer_gap).await;
        }
        progress!(
            "{label}: savevm p50 {} (n={}), vmstate {}",
            fmt_ms(case.p50(SAVEVM)),
            case.savevm_ms.len(),
            fmt_bytes(Summary::of(&case.savevm_vmstate_bytes).p50),
        );
        if workload == "writer" {
            let stop = measure::writer_stop_script();
            let (a, b) = tokio::join!(sh(&agent, &stop), peer.sh(&stop));
            a?;
            b?;
        }
    }
    drop(agent);
    peer.kill().await;
    brt.stop();
    Ok(())
}

// ------------------------------------------------------------------ report

fn render(ctx: &Ctx, args: &Args, res: &Results, sec: &mut Section) -> Result<()> {
    let bw_text = res
        .bandwidth
        .iter()
        .map(|b| {
            format!(
                "{} MB/s ({} pool)",
                fmt_num(b.median / 1e6),
                size_label(b.size_mib)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    sec.text(format!(
        "**Method.** Per guest size (1 vCPU, {accel}), one strata sandbox on its own btrfs pool and, booted alongside from the same image, a \
         stock-QEMU peer (root disk converted to qcow2 inside the same pool, RAM as plain anonymous memory, same size and vCPUs); both stay up \
         for the whole case, so each method is measured with the other VM running. Before measuring, {fill} % of each guest's RAM is filled with \
         random bytes and freed again, so RAM is populated as in a guest that has been working (zero pages would be skipped by a save). \
         Workloads: *idle*, and *writer* (a python process in each guest dirtying every page of a {rate} MiB working set once per second, \
         a tenth of it every 100 ms, i.e. {rate} MiB/s). Timed, per method:\n\n\
         - **strata**: `Runtime::snapshot`'s pause, from QMP `stop` to the reply of `cont` (device state saved with `x-ignore-shared`, one \
         read-only btrfs snapshot of the sandbox's subvolume holding RAM file and disk). {runs} snapshots {interval} ms apart per case, after one \
         untimed warm-up snapshot; each is deleted once the next is taken.\n\
         - **full save** (`virsh save`): on the same strata VM, `stop`, migrate *all* of RAM (`x-ignore-shared` off) over a local socket into a \
         file in the pool, fsync, `cont`; timed from `stop` to the reply of `cont`; the file is deleted after each run.\n\
         - **savevm** (`virsh snapshot-create`): on the peer, HMP `savevm` through QMP `human-monitor-command`; QEMU stops the VM for the whole \
         command, so the pause is its wall time. Each one's `vm-state-size` is read back with `qemu-img info -U` (proof it wrote RAM), then \
         `delvm` (untimed).\n\
         - **floor**: what a snapshot cannot beat on this disk: the bytes it had to write ÷ the pool's write bandwidth. The bytes are measured, \
         not assumed: the FIEMAP extent maps of the `mem` and `disk.img` files of consecutive snapshots are compared (data that moved = data \
         written since the previous snapshot, CoW), plus the device state. \
         strata ÷ floor near 1× means the pause is all writeback of what the guest dirtied; a little under 1× is the noise of the bandwidth \
         samples (taken on a quiet pool, the snapshots run beside two guests). Bandwidth: {bw_mib} MiB of random data written into a file in \
         the pool, then its fsync timed (the guest's dirty pages are in the page cache already: writing them back is the snapshot's share), \
         {bw_runs}× per size before the VMs start, median: {bw_text}.\n\n\
         Counts: {runs} strata snapshots per case; full saves and savevms {peer_gap_ms} ms apart, up to {peer_runs} each per case but \
         stopped once they have taken {budget} s (but at least 2 when the cap allows): each writes the whole populated RAM, seconds apiece at 2 GiB under TCG, so \
         the larger guests have fewer of them (see `n`).",
        accel = ctx.accel,
        fill = args.fill_percent.min(90),
        rate = args.write_rate,
        runs = args.runs,
        interval = args.interval_ms,
        bw_mib = args.bandwidth_mib,
        bw_runs = args.bandwidth_runs,
        peer_runs = args.peer_runs,
        peer_gap_ms = PEER_GAP_MS,
        budget = fmt_num(args.peer_budget_s),
        bw_text = if bw_text.is_empty() { "not measured".into() } else { bw_text },
    ));

    for workload in ["idle", "writer"] {
        let cases: Vec<&Case> = res
            .cases
            .iter()
            .filter(|c| c.workload == workload)
            .collect();
        if cases.is_empty() {
            continue;
        }
        let caption = if workload == "idle" {
            "Snapshot pause, idle guest".to_string()
        } else {
            format!("Snapshot pause, writer dirtying {} MiB/s", args.write_rate)
        };
        let mut t = Table::latency(caption, &["written (p50)", "ratio to strata (p50)"]);
        for c in cases {
            let s50 = c.p50(STRATA);
            for m in [STRATA, FULL, SAVEVM] {
                if c.samples(m).is_empty() {
                    continue;
                }
                let ratio = if m == STRATA {
                    "1×".into()
                } else {
                    fmt_ratio(c.p50(m), s50)
                };
                t.latency_row(
                    format!("{} · {m}", size_label(c.size_mib)),
                    &Summary::of(c.samples(m)),
                    vec![fmt_bytes(Summary::of(c.written(m)).p50), ratio],
                );
            }
        }
        sec.table(t);
    }

    if !res.cases.is_empty() {
        let mut t = Table::latency(
            "Physical floor: bytes each strata snapshot wrote ÷ the pool's write bandwidth (per snapshot)",
            &[
                "written p50",
                "written max",
                "pool MB/s",
                "strata p50",
                "strata ÷ floor (p50)",
            ],
        );
        for c in &res.cases {
            let bw = res
                .bandwidth
                .iter()
                .find(|b| b.size_mib == c.size_mib)
                .map(|b| b.median)
                .unwrap_or(f64::NAN);
            let w = Summary::of(&c.dirtied_bytes);
            t.latency_row(
                c.label(),
                &Summary::of(&c.floor_ms),
                vec![
                    fmt_bytes(w.p50),
                    fmt_bytes(w.max),
                    fmt_num(bw / 1e6),
                    fmt_ms(c.p50(STRATA)),
                    fmt_ratio(c.p50(STRATA), c.p50(FLOOR)),
                ],
            );
        }
        sec.table(t);
        sec.text(
            "Idle, a strata pause is almost all fixed cost (QMP round trips, the device-state save, the btrfs snapshot's \
             transaction commit), not data: the floor is far below it. Under the writer it follows the data the guest dirtied \
             since the previous snapshot. The alternatives write all populated RAM every time, whatever the guest did.",
        );
        let mut t = Table::new(
            "Where a strata pause goes: p50 (p99) of each step, ms (Runtime SnapshotInfo::phases; device state and btrfs snapshot run side by side, so the pause holds the longer of the two)",
            &[
                "case",
                "n",
                "QMP stop",
                "device state",
                "btrfs snapshot",
                "QMP cont",
                "pause",
                "sign (after cont)",
            ],
        );
        for c in &res.cases {
            let col = |f: fn(&strata_runtime::PausePhases) -> f64| {
                let v: Vec<f64> = c.phases.iter().map(f).collect();
                let s = Summary::of(&v);
                p50_p99(&s)
            };
            let pause = Summary::of(&c.strata_ms);
            t.row(vec![
                c.label(),
                c.phases.len().to_string(),
                col(|p| p.stop_ms),
                col(|p| p.device_state_ms),
                col(|p| p.btrfs_ms),
                col(|p| p.cont_ms),
                p50_p99(&pause),
                col(|p| p.sign_ms),
            ]);
        }
        sec.table(t);
    }
    if !res.cases.is_empty() {
        let mut t = Table::new(
            "Inside the device-state step: p50 (p99) of each of its steps, ms (strata_vmm::SaveSteps). A migration: the run-state check (with the capabilities on a VM's first save), `getfd` + `migrate`, until QEMU says completed, until the run state is finalized. A direct save (the default after a VM's first save): the check, `add-fd`, the save and `remove-fd` in one round trip (\"until completed\"), then the file completed in place (\"until finalized\"). Rows: the case's own series, then the A/B's two arms",
            &[
                "case",
                "n",
                "check (+caps)",
                "getfd + migrate",
                "until completed",
                "until finalized",
                "device state",
            ],
        );
        for c in &res.cases {
            let arms = [
                (c.label(), &c.phases),
                (
                    format!("{}, A/B before ({})", c.label(), args.ab_names().0),
                    &c.ab_before,
                ),
                (
                    format!("{}, A/B now ({})", c.label(), args.ab_names().1),
                    &c.ab_now,
                ),
            ];
            for (label, phases) in arms {
                if phases.is_empty() {
                    continue;
                }
                let col = |f: fn(&strata_vmm::SaveSteps) -> f64| {
                    let v: Vec<f64> = phases.iter().map(|p| f(&p.device_state_steps)).collect();
                    let s = Summary::of(&v);
                    p50_p99(&s)
                };
                let ds = device_state(phases);
                t.row(vec![
                    label,
                    phases.len().to_string(),
                    col(|s| s.check_ms),
                    col(|s| s.start_ms),
                    col(|s| s.complete_ms),
                    col(|s| s.finalize_ms),
                    p50_p99(&ds),
                ]);
            }
        }
        sec.table(t);
    }
    if res.cases.iter().any(|c| !c.ab_now.is_empty()) {
        let title = if args.ab_kind == "copies" {
            "The pause before (the btrfs snapshot of the subvolume under the pause, after a commit before it) vs now (by copies: RAM reflinked before the pause and caught up in it, the disk image reflinked in it, the btrfs snapshot after `cont`): p50 (p99), ms, the two interleaved one snapshot at a time on the same VM"
        } else if args.ab_kind == "migrate" {
            "The device-state save before (a migration: `migrate fd:` with `x-ignore-shared`, its `MIGRATION` event, the wait until finalized) vs now (the direct save: `xen-save-devices-state` into an `add-fd` set, completed in place by the driver), both beside the btrfs snapshot: p50 (p99), ms, the two interleaved one snapshot at a time on the same VM"
        } else {
            "The direct device-state save before (into the sandbox's `.device.state.tmp`, a file in the pool the btrfs snapshot beside it commits) vs now (into a memfd, completed in memory, written to the pool after `cont`): p50 (p99), ms, the two interleaved one snapshot at a time on the same VM"
        };
        let mut t = Table::new(
            title,
            &[
                "case",
                "n per arm",
                "device state, before",
                "device state, now",
                "pause, before",
                "pause, now",
                "pause p50 now ÷ before",
            ],
        );
        for c in res.cases.iter().filter(|c| !c.ab_now.is_empty()) {
            let ds = |v: &[strata_runtime::PausePhases]| {
                let s = device_state(v);
                p50_p99(&s)
            };
            let (pp, pe) = (Summary::of(&c.ab_before_ms), Summary::of(&c.ab_now_ms));
            t.row(vec![
                c.label(),
                c.ab_now.len().min(c.ab_before.len()).to_string(),
                ds(&c.ab_before),
                ds(&c.ab_now),
                p50_p99(&pp),
                p50_p99(&pe),
                format!("{:.2}×", pe.p50 / pp.p50),
            ]);
        }
        sec.table(t);
    }

    plots(ctx, res, sec)?;
    headlines(res, sec);
    sec.data = serde_json::json!({
        "params": {
            "sizes_mib": args.sizes,
            "runs": args.runs,
            "peer_runs": args.peer_runs,
            "peer_budget_s": args.peer_budget_s,
            "peer_gap_ms": PEER_GAP_MS,
            "write_rate_mib_s": args.write_rate,
            "interval_ms": args.interval_ms,
            "fill_percent": args.fill_percent.min(90),
            "bandwidth_mib": args.bandwidth_mib,
            "bandwidth_runs": args.bandwidth_runs,
            "save_ab": args.save_ab,
            "ab_kind": args.ab_kind,
            "vcpus": 1,
            "accel": ctx.accel.to_string(),
        },
        "results": res,
    });
    Ok(())
}

fn plots(ctx: &Ctx, res: &Results, sec: &mut Section) -> Result<()> {
    if res.cases.is_empty() {
        return Ok(());
    }
    let cats: Vec<String> = res.cases.iter().map(Case::label).collect();
    let series: Vec<(String, Vec<f64>)> = [STRATA, FULL, SAVEVM, FLOOR]
        .iter()
        .map(|m| {
            (
                m.to_string(),
                res.cases.iter().map(|c| c.p50(m)).collect::<Vec<f64>>(),
            )
        })
        .collect();
    let file = "snapshot-pause.svg";
    plot::bars(
        &ctx.file(file),
        "Snapshot pause (p50)",
        "pause, ms (log)",
        &cats,
        &series,
        true,
    )?;
    sec.plot(
        file,
        "p50 snapshot pause per guest size and workload: strata, full-memory save, savevm, and the physical floor (log scale)",
    );

    let largest = res.cases.iter().map(|c| c.size_mib).max().unwrap_or(0);
    let pick = res
        .cases
        .iter()
        .find(|c| c.size_mib == largest && c.workload == "writer")
        .or_else(|| res.cases.iter().find(|c| c.size_mib == largest));
    if let Some(c) = pick {
        let file = "snapshot-cdf.svg";
        let series: Vec<(String, Vec<f64>)> = [STRATA, FULL, SAVEVM, FLOOR]
            .iter()
            .filter(|m| !c.samples(m).is_empty())
            .map(|m| (m.to_string(), c.samples(m).to_vec()))
            .collect();
        plot::cdf(
            &ctx.file(file),
            &format!("Snapshot pause, {}", c.label()),
            "ms",
            &series,
        )?;
        sec.plot(
            file,
            format!(
                "CDF of every snapshot pause, {} (the floor per strata snapshot)",
                c.label()
            ),
        );
    }
    Ok(())
}

fn headlines(res: &Results, sec: &mut Section) {
    let Some(largest) = res.cases.iter().map(|c| c.size_mib).max() else {
        return;
    };
    for c in res.cases.iter().filter(|c| c.size_mib == largest) {
        let s = c.p50(STRATA);
        if !s.is_finite() {
            continue;
        }
        sec.headline(format!(
            "{}: strata pauses {} (p50, n={}) vs full save {} ({} longer) and savevm {} ({} longer); physical floor {} (strata at {} of it)",
            c.label(),
            fmt_ms(s),
            c.strata_ms.len(),
            fmt_ms(c.p50(FULL)),
            fmt_ratio(c.p50(FULL), s),
            fmt_ms(c.p50(SAVEVM)),
            fmt_ratio(c.p50(SAVEVM), s),
            fmt_ms(c.p50(FLOOR)),
            fmt_ratio(s, c.p50(FLOOR)),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_floor() {
        assert_eq!(size_label(256), "256 MiB");
        assert_eq!(size_label(2048), "2 GiB");
        assert_eq!(size_label(1536), "1536 MiB");
        // 100 MB at 1 GB/s is 100 ms.
        assert!((floor_ms(100e6, 1e9) - 100.0).abs() < 1e-9);
        assert!(floor_ms(1.0, 0.0).is_nan());
        let s = Duration::from_secs;
        assert!(within_budget(0, s(100), 8.0) && within_budget(1, s(100), 8.0));
        assert!(within_budget(2, s(7), 8.0) && !within_budget(2, s(8), 8.0));
    }

    #[test]
    fn case_picks_samples_per_method() {
        let c = Case {
            size_mib: 1024,
            workload: "writer".into(),
            strata_ms: vec![3.0, 1.0, 2.0],
            full_save_ms: vec![100.0],
            floor_ms: vec![0.5],
            ..Case::default()
        };
        assert_eq!(c.label(), "1 GiB writer");
        assert_eq!(c.p50(STRATA), 2.0);
        assert_eq!(c.p50(FULL), 100.0);
        assert!(c.p50(SAVEVM).is_nan());
        assert_eq!(c.p50(FLOOR), 0.5);
    }

    #[test]
    fn vmstate_size_from_qemu_img_info() {
        let info = serde_json::json!({
            "format": "qcow2",
            "snapshots": [
                {"name": "other", "vm-state-size": 1},
                {"name": "bench0", "vm-state-size": 123456789u64, "id": "1"}
            ]
        });
        assert_eq!(peer::parse_vmstate(&info, "bench0").unwrap(), 123456789);
        assert!(peer::parse_vmstate(&info, "missing").is_err());
        assert!(peer::parse_vmstate(&serde_json::json!({}), "bench0").is_err());
    }

    #[test]
    fn guest_scripts() {
        assert!(measure::fill_script(128).contains("* 128"));
        let w = measure::writer_start_script(64);
        assert!(w.contains(measure::WRITER) && w.contains(" 64 >/dev/null"));
        assert!(measure::writer_stop_script().starts_with("pkill -f "));
    }

    #[test]
    fn render_reports_partial_results() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Ctx {
            out: dir.path().to_path_buf(),
            image: dir.path().to_path_buf(),
            accel: strata_core::Accel::Tcg,
            qemu: "qemu-system-x86_64".into(),
            smoke: true,
        };
        let mut args = Args {
            sizes: vec![],
            runs: 0,
            peer_runs: 0,
            peer_budget_s: 8.0,
            write_rate: 64,
            interval_ms: 500,
            fill_percent: 25,
            bandwidth_mib: 1,
            bandwidth_runs: 1,
            save_ab: 2,
            ab_kind: "memory".into(),
        };
        args.smoke();
        let res = Results {
            bandwidth: vec![Bandwidth {
                size_mib: 256,
                samples: vec![5e8],
                median: 5e8,
            }],
            cases: vec![Case {
                size_mib: 256,
                workload: "idle".into(),
                strata_ms: vec![10.0, 12.0],
                dirtied_bytes: vec![1e6, 2e6],
                floor_ms: vec![2.0, 4.0],
                full_save_ms: vec![500.0],
                full_save_bytes: vec![1e8],
                ..Case::default()
            }],
            ..Results::default()
        };
        let mut sec = Section::new("snapshot", "t");
        render(&ctx, &args, &res, &mut sec).unwrap();
        assert!(dir.path().join("snapshot-pause.svg").exists());
        assert!(dir.path().join("snapshot-cdf.svg").exists());
        assert_eq!(sec.headline.len(), 1);
        assert!(
            sec.headline[0].contains("256 MiB idle"),
            "{:?}",
            sec.headline
        );
        let md = serde_json::to_string(&sec.blocks).unwrap();
        assert!(md.contains("256 MiB · full save"));
        // Nearest-rank p50 of [10, 12] is 10: 500 / 10.
        assert!(md.contains("50.00×"), "{md}");
    }
}
