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

mod workload;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use chrono::{DateTime, TimeZone, Utc};
use rand::{seq::SliceRandom, SeedableRng};
use serde_json::json;
use strata_core::{SandboxId, SandboxSize, SnapshotId};
use strata_proto::client::{AgentClient, ExecRequest};
use strata_runtime::meta::files;
use strata_runtime::{Runtime, Source};
use strata_storage::{file_extent_map, rewritten_bytes, FileExtent};
use stratad::retention::{Point, RetentionPolicy};
use stratad::store::SnapshotKind;

use crate::ctx::{BenchRuntime, Ctx};
use crate::plot::{self, Series};
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_ratio, Samples};

use workload::{GUEST_RAM_DIR, GUEST_REPO, GUEST_TOOLS, GUEST_WHEELS, GUEST_WORK};

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

/// Runs `script` with `sh -c` after `set -e`; stdout on success.
async fn sh(agent: &AgentClient, script: &str) -> Result<String> {
    let out = agent
        .exec_collect(ExecRequest::shell(format!("set -e\n{script}")))
        .await
        .with_context(|| format!("exec {script:?}"))?;
    if !out.status.success() {
        bail!(
            "guest command failed ({:?}): {script}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn read_text(agent: &AgentClient, path: &str) -> Result<String> {
    let mut dl = agent
        .read_file(path)
        .await
        .with_context(|| format!("read {path}"))?;
    let mut v = Vec::new();
    while let Some(c) = dl.next_chunk().await {
        v.extend_from_slice(&c.with_context(|| format!("read {path}"))?);
    }
    Ok(String::from_utf8_lossy(&v).into_owned())
}

async fn write_bytes(agent: &AgentClient, path: &str, data: &[u8]) -> Result<()> {
    agent
        .write_file(path, None, data)
        .await
        .with_context(|| format!("upload {path}"))?;
    Ok(())
}

async fn counter(agent: &AgentClient) -> Result<(u64, u32)> {
    workload::parse_counter(&read_text(agent, &format!("{GUEST_RAM_DIR}/counter")).await?)
}

async fn disk_written(agent: &AgentClient) -> Result<u64> {
    workload::disk_written_bytes(&read_text(agent, "/sys/block/vda/stat").await?)
}

/// Day number and time of a virtual instant, from the start of the history.
fn vtime(t0: DateTime<Utc>, at: DateTime<Utc>) -> String {
    let m = (at - t0).num_minutes();
    format!("day {} {:02}:{:02}", m / 1440, (m % 1440) / 60, m % 60)
}

/// The tier index a snapshot of age `age` falls in (`tiers.len()` past the last).
fn tier_of(policy: &RetentionPolicy, age: Duration) -> usize {
    policy
        .tiers
        .iter()
        .position(|t| age < t.within)
        .unwrap_or(policy.tiers.len())
}

/// Describes the policy as `1h: all, 1d: 1 per 10m, …`.
fn describe(policy: &RetentionPolicy) -> String {
    use stratad::duration::format_duration as f;
    policy
        .tiers
        .iter()
        .map(|t| {
            if t.every.is_zero() {
                format!("younger than {}: every snapshot", f(t.within))
            } else {
                format!("younger than {}: one per {}", f(t.within), f(t.every))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether the loop step at virtual `minute` runs an activity step (the first
/// three snapshot slots of every burst period).
fn is_activity(minute: u64, every: u64, burst_every: u64) -> bool {
    (minute % burst_every) / every < 3
}

/// Runs the policy alone (no snapshots) over `minutes` virtual minutes, one
/// point every `every` minutes, GC after each as the loop does; returns how
/// many points survive.
fn simulate_kept(policy: &RetentionPolicy, every: u64, minutes: u64, t0: DateTime<Utc>) -> usize {
    let mut live: Vec<Point<u64>> = Vec::new();
    let mut m = 0;
    while m < minutes {
        let at = t0 + chrono::Duration::minutes(m as i64);
        live.push(Point {
            id: m,
            at,
            kind: SnapshotKind::Rolling,
        });
        let del = policy.to_delete(&live, at);
        live.retain(|p| !del.contains(&p.id));
        m += every;
    }
    live.len()
}

/// `k` random snapshots of `live`, preferring distinct workspace states (so the
/// rewinds check different disk states, not the same one after a long idle
/// stretch): a random order, the first snapshot of each state taken first,
/// then the rest in that order.
fn pick_rewinds(live: &[Snap], k: usize, rng: &mut impl rand::Rng) -> Vec<Snap> {
    let mut order: Vec<&Snap> = live.iter().collect();
    order.shuffle(rng);
    let mut seen = std::collections::HashSet::new();
    let (first, rest): (Vec<&Snap>, Vec<&Snap>) =
        order.into_iter().partition(|s| seen.insert(s.state));
    first.into_iter().chain(rest).take(k).cloned().collect()
}

/// Keeps at most `max` points, evenly spaced, always the last one.
fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points.to_vec();
    }
    let stride = points.len().div_ceil(max - 1);
    let mut v: Vec<(f64, f64)> = points.iter().step_by(stride).copied().collect();
    if let Some(last) = points.last() {
        if v.last() != Some(last) {
            v.push(*last);
        }
    }
    v
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let policy = match &args.history_retention {
        Some(s) => RetentionPolicy::parse(s).map_err(|e| anyhow!("--history-retention: {e}"))?,
        None => stratad::config::Config::default().retention,
    };
    if args.history_every == 0 {
        bail!("--history-every must be at least 1 (virtual minute)");
    }
    let every = args.history_every;
    let steps = ((args.history_days * 1440.0) / every as f64)
        .round()
        .max(2.0) as u64;
    let burst_every = args.history_burst_every.max(every);
    let seed = args.history_seed.unwrap_or_else(rand::random);
    eprintln!(
        "history: {steps} snapshots, one per {every} virtual minute(s) = {:.2} virtual days; retention {}; rewind seed {seed}",
        (steps * every) as f64 / 1440.0,
        describe(&policy)
    );
    sec.data = json!({
        "params": {
            "steps": steps, "every_minutes": every, "days": args.history_days,
            "retention": policy, "memory_mib": args.history_mem, "rewinds": args.history_rewinds,
            "seed": seed, "burst_every_minutes": burst_every,
        }
    });

    // ---------------------------------------------------------------- host side
    let host = tempfile::Builder::new()
        .prefix("strata-bench-history-host-")
        .tempdir_in("/tmp")
        .context("host scratch dir")?;
    let repo_dir = host.path().join("repo");
    // Smoke size: a smaller repository (the clone dominates a smoke run's time).
    let (repo_files, repo_commits) = if ctx.smoke { (60, 3) } else { (300, 8) };
    let repo_tar = host.path().join("repo.tar");
    {
        let (d, t) = (repo_dir.clone(), repo_tar.clone());
        tokio::task::spawn_blocking(move || workload::make_repo(&d, &t, repo_files, repo_commits))
            .await
            .context("make the repository")??;
    }
    let wheels = workload::wheels();

    // ---------------------------------------------------------------- guest setup
    let env = BenchRuntime::start(ctx, "strata-bench-history-", 16, |_| {}).await?;
    let rt: Arc<Runtime> = env.rt.clone();
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: args.history_mem,
        disk_gib: 2,
    };
    let (tpl, boot_ms) = env.template(size).await?;
    eprintln!("history: template ready (cold boot {})", fmt_ms(boot_ms));
    let id = SandboxId::generate();
    rt.create(&id, &Source::Template(tpl), None)
        .await
        .context("create the sandbox")?;
    let agent = rt.agent(&id).await.context("agent")?;
    let t_setup = Instant::now();
    let site = sh(
        &agent,
        &format!(
            "mkdir -p {GUEST_WHEELS} {GUEST_TOOLS} {GUEST_WORK} {GUEST_RAM_DIR}\n\
             grep -q ' {GUEST_RAM_DIR} ' /proc/mounts || mount -t tmpfs -o size=8m tmpfs {GUEST_RAM_DIR}\n\
             python3 -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))'"
        ),
    )
    .await?
    .trim()
    .to_owned();
    let tar = tokio::fs::read(&repo_tar).await.context("read repo.tar")?;
    write_bytes(&agent, "/srv/repo.tar", &tar).await?;
    for (name, data) in &wheels {
        write_bytes(&agent, &format!("{GUEST_WHEELS}/{name}"), data).await?;
    }
    for (name, text) in [
        ("install.py", workload::INSTALLER_PY),
        ("counter.py", workload::COUNTER_PY),
        ("edit.py", workload::EDIT_PY),
    ] {
        write_bytes(&agent, &format!("{GUEST_TOOLS}/{name}"), text.as_bytes()).await?;
    }
    let commits = sh(
        &agent,
        &format!(
            "mkdir -p {GUEST_REPO} && tar -xf /srv/repo.tar -C {GUEST_REPO} && rm /srv/repo.tar\n\
             git -C {GUEST_REPO} rev-list --count HEAD\n\
             setsid python3 {GUEST_TOOLS}/counter.py </dev/null >/dev/null 2>&1 &\n\
             sync"
        ),
    )
    .await?;
    let mut first = None;
    for _ in 0..100 {
        if let Ok(c) = counter(&agent).await {
            first = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (mut last_counter, counter_pid) =
        first.ok_or_else(|| anyhow!("the long-running counter process did not start"))?;
    let written0 = disk_written(&agent).await?;
    let wheel_bytes: usize = wheels.iter().map(|w| w.1.len()).sum();
    eprintln!(
        "history: guest set up in {:.1} s: repo of {repo_files}+ files in {} commits ({}), {} wheels ({}), counter pid {counter_pid}, site-packages {site}",
        t_setup.elapsed().as_secs_f64(),
        commits.trim(),
        fmt_bytes(tar.len() as f64),
        wheels.len(),
        fmt_bytes(wheel_bytes as f64),
    );

    sec.text(format!(
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
        (steps * every) as f64 / 1440.0,
        describe(&policy),
        commits.trim(),
        wheels.len(),
        fmt_bytes(wheel_bytes as f64),
    ));

    // ---------------------------------------------------------------- the loop
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
    // What the guest changed between consecutive snapshots, RAM and disk:
    // the extents of each snapshot's `mem` and `disk.img` that moved since
    // the previous snapshot (copy-on-write), compared while both exist.
    let mut changed = 0u64;
    let mut changed_series: Vec<(f64, f64)> = vec![(0.0, 0.0)];
    let mut prev_maps: Option<(Vec<FileExtent>, Vec<FileExtent>)> = None;
    let t_loop = Instant::now();
    let checksum_cmd = workload::checksum_cmd(&site);
    for i in 0..steps {
        let minute = i * every;
        let at = t0 + chrono::Duration::minutes(minute as i64);
        let days = minute as f64 / 1440.0;
        if is_activity(minute, every, burst_every) {
            let st = workload::step(activity);
            let t = Instant::now();
            sh(&agent, &st.script)
                .await
                .with_context(|| format!("activity step {activity} ({})", st.label))?;
            let a_ms = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let checksum = sh(&agent, &checksum_cmd).await?.trim().to_owned();
            let c_ms = t.elapsed().as_secs_f64() * 1000.0;
            if checksum.len() != 64 {
                bail!("workspace checksum: unexpected output {checksum:?}");
            }
            last_written = disk_written(&agent).await?.saturating_sub(written0);
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
            &agent,
            &format!("{GUEST_RAM_DIR}/step"),
            i.to_string().as_bytes(),
        )
        .await?;
        let probe_ms = t.elapsed().as_secs_f64() * 1000.0;
        let snap = SnapshotId::generate();
        let t = Instant::now();
        let info = rt
            .snapshot(&id, &snap)
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
        let (c, _) = counter(&agent).await?;
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
    let rate = steps as f64 / loop_s;
    let now = t0 + chrono::Duration::minutes(((steps - 1) * every) as i64);

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

    // Surviving snapshots per tier.
    let mut tiers = Table::new(
        format!(
            "Surviving snapshots per retention tier at the end ({} taken, {deleted} deleted by retention, {} kept)",
            steps,
            live.len()
        ),
        &["tier (age)", "rule", "kept", "expected", "oldest kept", "newest kept"],
    );
    let mut prev = Duration::ZERO;
    for (ti, t) in policy.tiers.iter().enumerate() {
        let in_tier: Vec<&Snap> = live
            .iter()
            .filter(|s| tier_of(&policy, (now - s.at).to_std().unwrap_or_default()) == ti)
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
        use stratad::duration::format_duration as f;
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
            tier_of(&policy, (now - s.at).to_std().unwrap_or_default()) == policy.tiers.len()
        })
        .count();
    tiers.row(vec![
        format!("older than {}", stratad::duration::format_duration(prev)),
        "deleted".into(),
        beyond.to_string(),
        "0".into(),
        "–".into(),
        "–".into(),
    ]);
    sec.table(tiers);

    let mut bytes = Table::new(
        format!(
            "Bytes at the end of {:.2} virtual days (pool figures after the trash emptied and btrfs synced: {settle_s:.1} s)",
            (steps * every) as f64 / 1440.0
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
        fmt_bytes(last_written as f64),
        format!(
            "sectors written by the guest kernel to its disk; pool / writes = {}",
            fmt_ratio(used_end as f64, last_written as f64)
        ),
    ]);
    bytes.row(vec![
        "RAM + disk the guest changed, snapshot to snapshot".into(),
        fmt_bytes(changed as f64),
        format!(
            "extents of `mem` and `disk.img` rewritten between consecutive snapshots (FIEMAP), summed \
             over all {steps}; retention drops the intermediate states: pool / changed = {}",
            fmt_ratio(used_end as f64, changed as f64)
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

    let mut lat = Table::latency(
        format!(
            "Times during the loop: {steps} snapshots in {loop_s:.1} s = {rate:.2} snapshots/s sustained (with retention, deletes, activity and probes)"
        ),
        &[],
    );
    lat.latency_row("snapshot pause (vCPUs stopped)", &pauses.summary(), vec![]);
    lat.latency_row(
        "snapshot call (Runtime::snapshot)",
        &snap_calls.summary(),
        vec![],
    );
    lat.latency_row(
        "retention delete (Runtime::delete_snapshot)",
        &deletes.summary(),
        vec![],
    );
    lat.latency_row(
        "RAM marker write + counter read (agent file API)",
        &probes.summary(),
        vec![],
    );
    lat.latency_row("activity step (guest exec)", &activity_ms.summary(), vec![]);
    lat.latency_row(
        "workspace checksum (guest exec)",
        &checksum_ms.summary(),
        vec![],
    );
    sec.table(lat);

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
            (steps * every) as f64 / 1440.0
        ),
        "virtual days",
        "MiB  (snapshots kept: count)",
        &[
            Series::new("pool bytes used above start (MiB)", mib(&used_series)),
            Series::new("cumulative guest disk writes (MiB)", mib(&written_series)),
            Series::new(
                "cumulative RAM + disk changed between snapshots (MiB)",
                mib(&thin(&changed_series, 1000)),
            ),
            Series::new("snapshots kept (count)", thin(&kept_series, 400)),
        ],
        false,
    )?;
    sec.plot(
        file,
        "Pool bytes used (above the start of the loop), the guest's cumulative disk writes and the RAM + disk it changed between snapshots, in MiB, and the number of snapshots kept, over virtual time",
    );
    sec.data["loop"] = json!({
        "seconds": loop_s, "snapshots_per_s": rate, "deleted": deleted, "kept": live.len(),
        "used_start": used_start, "used_end_above_start": used_end, "guest_written": last_written,
        "mem_bytes": mem_bytes, "disk_allocated": disk_alloc, "logical_kept": logical,
        "pause_ms": pauses.0, "snapshot_call_ms": snap_calls.0, "delete_ms": deletes.0,
        "probe_ms": probes.0, "states": states,
        "used_series": thin(&used_series, 1000), "kept_series": thin(&kept_series, 1000),
        "written_series": written_series, "changed": changed,
        "changed_series": thin(&changed_series, 1000),
    });
    let pause = pauses.summary();
    sec.headline(format!(
        "{steps} real snapshots ({:.2} virtual days at 1 per {every} min) at {rate:.1} snapshots/s with the daemon's retention: {} kept; pool grew {} while the guest wrote {} to disk and changed {} of RAM + disk between snapshots, vs {} logical RAM + disk in the kept snapshots; pause p50 {} / p99 {} (n={})",
        (steps * every) as f64 / 1440.0,
        live.len(),
        fmt_bytes(used_end as f64),
        fmt_bytes(last_written as f64),
        fmt_bytes(changed as f64),
        fmt_bytes(logical as f64),
        fmt_ms(pause.p50),
        fmt_ms(pause.p99),
        pause.n,
    ));

    // ---------------------------------------------------------------- rewinds
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let picks = pick_rewinds(&live, args.history_rewinds, &mut rng);
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
        rt.rewind(&id, &s.id, None)
            .await
            .with_context(|| format!("rewind to {}", vtime(t0, s.at)))?;
        let r_ms = t.elapsed().as_secs_f64() * 1000.0;
        rewind_ms.push(r_ms);
        let agent = rt.agent(&id).await.context("agent after rewind")?;
        let marker = read_text(&agent, &format!("{GUEST_RAM_DIR}/step")).await?;
        let (c1, pid1) = counter(&agent).await?;
        let since = t.elapsed().as_secs_f64();
        let sum = sh(&agent, &checksum_cmd).await?.trim().to_owned();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (c2, pid2) = counter(&agent).await?;
        let want = &states[s.state];
        let sum_ok = sum == want.checksum;
        let marker_ok = marker.trim() == s.step.to_string();
        let hi = s.counter_hi + since.ceil() as u64 + 1;
        let counter_ok = c1 >= s.counter_lo && c1 <= hi;
        let alive = pid1 == counter_pid && pid2 == pid1 && c2 > c1;
        let ok = sum_ok && marker_ok && counter_ok && alive;
        if !ok {
            failures.push(vtime(t0, s.at));
        }
        let tier = tier_of(&policy, (now - s.at).to_std().unwrap_or_default());
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
    let week = 7 * 1440;
    let week_steps = week / every;
    let week_activity = (0..week_steps)
        .filter(|i| is_activity(i * every, every, burst_every))
        .count() as f64;
    let act_total_ms: f64 = states.iter().map(|s| s.activity_ms + s.checksum_ms).sum();
    let idle_ms = (loop_s * 1000.0 - act_total_ms) / steps as f64;
    let act_ms = act_total_ms / states.len().max(1) as f64;
    let week_est_min = (week_steps as f64 * idle_ms + week_activity * act_ms) / 60_000.0;
    let week_kept = simulate_kept(&policy, every, week, t0);
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
        (steps * every) as f64 / 1440.0,
        week_activity,
    ));
    sec.data["week_estimate"] = json!({
        "steps": week_steps, "activity_steps": week_activity, "idle_ms_per_step": idle_ms,
        "activity_ms_per_step": act_ms, "minutes": week_est_min, "retention_kept": week_kept,
    });
    sec.data["rewinds"] = json!(rewinds_data);
    let rw = rewind_ms.summary();
    sec.headline(format!(
        "{} of {} rewinds to random surviving snapshots restored exactly that state (workspace sha256, RAM marker, live process counter); rewind p50 {} (n={})",
        picks.len() - failures.len(),
        picks.len(),
        fmt_ms(rw.p50),
        rw.n
    ));
    let _ = rt.delete(&id).await;
    env.stop();
    if !failures.is_empty() {
        bail!(
            "{} rewind(s) did not restore the recorded state: {}",
            failures.len(),
            failures.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_and_thinning() {
        let p = RetentionPolicy::default();
        assert_eq!(tier_of(&p, Duration::from_secs(30 * 60)), 0);
        assert_eq!(tier_of(&p, Duration::from_secs(2 * 3600)), 1);
        assert_eq!(tier_of(&p, Duration::from_secs(3 * 86400)), 2);
        assert_eq!(tier_of(&p, Duration::from_secs(8 * 86400)), 3);
        assert!(describe(&p).contains("one per 10m"));
        let t0 = Utc.with_ymd_and_hms(2026, 1, 5, 0, 0, 0).unwrap();
        // A week of minutes under the default tiers: 60 + ~139 + ~145.
        let kept = simulate_kept(&p, 1, 7 * 1440, t0);
        assert!((340..=350).contains(&kept), "{kept}");
        assert_eq!(simulate_kept(&p, 1, 30, t0), 30);
        assert!(is_activity(0, 1, 120) && is_activity(2, 1, 120) && !is_activity(3, 1, 120));
        assert!(is_activity(240, 1, 120) && !is_activity(239, 1, 120));
        let snaps: Vec<Snap> = (0..50u64)
            .map(|i| Snap {
                id: SnapshotId::generate(),
                step: i,
                at: t0,
                state: if i < 45 { 0 } else { 1 + (i as usize % 2) },
                counter_lo: 0,
                counter_hi: 0,
            })
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let p3 = pick_rewinds(&snaps, 3, &mut rng);
        let states: std::collections::HashSet<usize> = p3.iter().map(|s| s.state).collect();
        assert_eq!(states.len(), 3, "three distinct states first");
        assert_eq!(pick_rewinds(&snaps, 10, &mut rng).len(), 10);
        assert_eq!(pick_rewinds(&snaps[..2], 5, &mut rng).len(), 2);
        let pts: Vec<(f64, f64)> = (0..1000).map(|i| (i as f64, 0.0)).collect();
        let t = thin(&pts, 100);
        assert!(t.len() <= 101 && t.len() >= 50);
        assert_eq!(t.last(), pts.last());
        assert_eq!(thin(&pts[..10], 100).len(), 10);
        let t0b = Utc.with_ymd_and_hms(2026, 1, 5, 0, 0, 0).unwrap();
        assert_eq!(
            vtime(t0b, t0b + chrono::Duration::minutes(1440 * 2 + 65)),
            "day 2 01:05"
        );
    }

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
