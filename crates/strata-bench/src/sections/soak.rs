//! Section `soak` (opt-in: `strata-bench --only soak`; two hours by
//! default): does a host that snapshots every running sandbox once a minute,
//! with the default retention, hold its pause times and its resources over
//! hours? Issue 18's soak: the last window's pause p99 within 1.2× of the
//! first window's.
//!
//! One daemon with `snapshot_interval` (default 60 s), the default retention
//! and `[snapshots] skip_unchanged` on; `n` sandboxes (default 20), each
//! running a small writer in the guest (a line appended to a file every
//! 5 s), so every rolling snapshot is really taken, not recorded as
//! `same_as`. Every `window` (default 10 min) the section reads, for the
//! window just ended:
//!
//! - the pause of every rolling snapshot taken in it (`pause_ms` of the
//!   snapshots API): n, p50, p99, max;
//! - where the pauses went: the btrfs snapshot and the device-state save,
//!   p50 (p99), from the in-process daemon's `snapshot taken` events
//!   ([`crate::pauses`]);
//! - snapshots kept in all (retention deletes as it goes);
//! - btrfs subvolumes deleted and not yet cleaned (`btrfs subvolume list -d`);
//! - pool data and metadata used (`btrfs filesystem df`);
//! - the resident memory of this process, which *is* the daemon (the daemon
//!   runs in-process: the figure includes the bench's own few MiB).
//!
//! A guest that stops answering an exec at a window's end is reported and
//! the run goes on.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use chrono::{DateTime, Utc};
use reqwest::Method;
use serde_json::json;
use strata_core::SandboxSize;

use crate::ctx::{BenchDaemon, Ctx};
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_ratio, Samples};

/// Flags of the `soak` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "soak-args")]
pub struct Args {
    /// Running sandboxes.
    #[arg(id = "soak-n", long = "soak-n", default_value_t = 20)]
    pub n: usize,
    /// Minutes the soak runs.
    #[arg(id = "soak-minutes", long = "soak-minutes", default_value_t = 120)]
    pub minutes: u64,
    /// Seconds between two rolling snapshots of a sandbox.
    #[arg(id = "soak-interval", long = "soak-interval", default_value_t = 60)]
    pub interval_s: u64,
    /// Seconds per reported window.
    #[arg(id = "soak-window", long = "soak-window", default_value_t = 600)]
    pub window_s: u64,
    /// Guest memory, MiB.
    #[arg(id = "soak-mem", long = "soak-mem", default_value_t = 256)]
    pub mem_mib: u32,
    /// Commit the pool's btrfs transaction before each pause (the default;
    /// `false` for the run without it: `Runtime::set_commit_before_pause`).
    #[arg(
        id = "soak-commit-before-pause",
        long = "soak-commit-before-pause",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub commit_before_pause: bool,
    /// Pause by reflink copies of RAM and disk, the btrfs snapshot after
    /// `cont` (the default; `false` for the btrfs snapshot under the pause:
    /// `Runtime::set_copies_in_pause`).
    #[arg(
        id = "soak-copies-in-pause",
        long = "soak-copies-in-pause",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub copies_in_pause: bool,
    /// Paused by copies, the copies are the snapshot's own files, the
    /// snapshot made before the pause (the default; `false` for copies in
    /// the subvolume's `.pause/` and the snapshot after `cont`:
    /// `Runtime::set_copies_into_snapshot`).
    #[arg(
        id = "soak-copies-into-snapshot",
        long = "soak-copies-into-snapshot",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub copies_into_snapshot: bool,
    /// Divides the default retention's times by this (1: the default
    /// retention). With `--soak-interval` shortened by the same factor, a
    /// short run goes through the default retention's shape: retention
    /// starts deleting after 60 / scale minutes.
    #[arg(
        id = "soak-retention-scale",
        long = "soak-retention-scale",
        default_value_t = 1
    )]
    pub retention_scale: u32,
    /// A/B inside one run: every this many seconds the pause method
    /// alternates (copies, then the btrfs snapshot under the pause, …), and
    /// each window reports both arms' pauses apart (from the daemon's
    /// `snapshot taken` events). 0: off (`--soak-copies-in-pause` holds).
    #[arg(id = "soak-ab-secs", long = "soak-ab-secs", default_value_t = 0)]
    pub ab_secs: u64,
    /// What `--soak-ab-secs` alternates: `method` (copies, then the btrfs
    /// snapshot under the pause) or `boost` (pauses boosted, then not:
    /// `Runtime::set_pause_boost`; the arms' columns are then boosted and
    /// not boosted).
    #[arg(id = "soak-ab-kind", long = "soak-ab-kind", default_value = "method")]
    pub ab_kind: AbKind,
    /// Pauses boosted (the default; `false` for the run without:
    /// `Runtime::set_pause_boost`).
    #[arg(
        id = "soak-pause-boost",
        long = "soak-pause-boost",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub pause_boost: bool,
    /// Snapshots made read-only as they are taken (a second commit each;
    /// `Runtime::set_seal_at_snapshot`). Off by default: sealed when a send
    /// first needs it.
    #[arg(
        id = "soak-seal-at-snapshot",
        long = "soak-seal-at-snapshot",
        default_value_t = false,
        action = clap::ArgAction::Set
    )]
    pub seal_at_snapshot: bool,
    /// Guests' disk flushes passed to the host's disk (`[vm]
    /// guest_disk_flush`; on by default).
    #[arg(
        id = "soak-guest-disk-flush",
        long = "soak-guest-disk-flush",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub guest_disk_flush: bool,
}

/// What an A/B soak alternates (`--soak-ab-kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AbKind {
    /// The pause method: copies, then the btrfs snapshot under the pause.
    Method,
    /// The pause boost: on, then off.
    Boost,
}

impl Args {
    /// Shrinks the run to the CI smoke size (about a minute).
    pub fn smoke(&mut self) {
        self.n = self.n.min(2);
        self.minutes = self.minutes.min(1);
        self.interval_s = self.interval_s.min(5);
        self.window_s = self.window_s.min(20);
    }
}

/// The writer each guest runs: a line every 5 s, so no rolling snapshot is
/// skipped as unchanged.
const WRITER: &str = "nohup sh -c 'while true; do date >> /root/soak.log; sleep 5; done' \
                      >/dev/null 2>&1 &";

/// One window's figures.
struct Window {
    end_min: f64,
    pauses: Samples,
    kept: usize,
    pending_deletions: usize,
    data_used: u64,
    meta_used: u64,
    rss: u64,
    unanswered: usize,
    /// The host's 5-minute load average at the window's end: the machine
    /// may be shared, and a pause is only as steady as its neighbours.
    load5: f64,
    /// The pool's btrfs transaction commits in the window, all of them
    /// (the daemon's, the guests' flushes', btrfs's own), and their mean
    /// duration, ms (`/sys/fs/btrfs/<uuid>/commit_stats`); `None` when
    /// unreadable.
    commits: Option<(u64, f64)>,
    /// Pause phases of every snapshot the daemon took in the window (its
    /// `snapshot taken` events: rolling and any other).
    phases: Vec<crate::pauses::Phases>,
}

/// The 5-minute load average (`/proc/loadavg`), 0 when unreadable.
fn load5() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// The pool's file system uuid (`btrfs filesystem show`).
fn pool_uuid(pool: &Path) -> Option<String> {
    let out = std::process::Command::new("btrfs")
        .args(["filesystem", "show"])
        .arg(pool)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.split("uuid:")
            .nth(1)?
            .split_whitespace()
            .next()?
            .to_owned(),
    )
}

/// The pool's `commit_stats` (commits, total commit ms) since it was
/// mounted: `/sys/fs/btrfs/<uuid>/commit_stats`.
fn commit_stats(uuid: Option<&str>) -> Option<(u64, u64)> {
    let stats = std::fs::read_to_string(format!("/sys/fs/btrfs/{}/commit_stats", uuid?)).ok()?;
    let field = |name: &str| -> Option<u64> {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((field("commits ")?, field("total_commit_ms ")?))
}

/// Resident memory of this process (VmRSS), bytes.
fn rss() -> u64 {
    strata_vmm::self_rss().unwrap_or(0)
}

/// Subvolumes deleted and not yet cleaned by btrfs.
fn pending_deletions(pool: &Path) -> Result<usize> {
    let out = std::process::Command::new("btrfs")
        .args(["subvolume", "list", "-d"])
        .arg(pool)
        .output()
        .context("btrfs subvolume list -d")?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count())
}

/// A window's pool commits: "n (mean ms)", "–" when unknown.
fn commits_cell(c: Option<(u64, f64)>) -> String {
    match c {
        Some((n, mean)) => format!("{n} ({mean:.0} ms)"),
        None => "–".into(),
    }
}

/// (data used, metadata used) of the pool, bytes (`btrfs filesystem df -b`).
fn pool_df(pool: &Path) -> Result<(u64, u64)> {
    let out = std::process::Command::new("btrfs")
        .args(["filesystem", "df", "-b"])
        .arg(pool)
        .output()
        .context("btrfs filesystem df")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let used = |kind: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(kind))
            .filter_map(|l| l.split("used=").nth(1))
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .sum()
    };
    Ok((used("Data"), used("Metadata")))
}

/// Rolling snapshots of `id` created in `[from, to)`: their pause ms; and
/// how many snapshots the sandbox keeps.
async fn window_pauses(
    d: &BenchDaemon,
    id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<(Vec<f64>, usize)> {
    let (s, v) = d
        .http
        .json(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None)
        .await?;
    if s != 200 {
        return Err(anyhow!("snapshots of {id}: {s} {v}"));
    }
    let items = v["items"]
        .as_array()
        .or_else(|| v.as_array())
        .cloned()
        .unwrap_or_default();
    let mut pauses = Vec::new();
    for it in &items {
        if it["kind"] != "rolling" || it.get("same_as").is_some_and(|x| !x.is_null()) {
            continue;
        }
        let Some(at) = it["created_at"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc))
        else {
            continue;
        };
        if at >= from && at < to {
            if let Some(p) = it["pause_ms"].as_f64() {
                pauses.push(p);
            }
        }
    }
    Ok((pauses, items.len()))
}

/// `p50 (p99)` of one phase over a window's snapshots.
fn phase_cell(v: &[crate::pauses::Phases], f: fn(&crate::pauses::Phases) -> f64) -> String {
    let s = crate::stats::Summary::of(&v.iter().map(f).collect::<Vec<_>>());
    if s.n == 0 {
        return "–".into();
    }
    format!("{} ({})", fmt_ms(s.p50), fmt_ms(s.p99))
}

/// A phase of the pauses by copies only.
fn copies_cell(v: &[crate::pauses::Phases], f: fn(&crate::pauses::Phases) -> f64) -> String {
    let x: Vec<crate::pauses::Phases> = v.iter().filter(|p| p.copies_in_pause).copied().collect();
    phase_cell(&x, f)
}

/// One A/B arm's pauses in a window (the `snapshot taken` events): by
/// method, `a` is by copies; by boost, `a` is boosted.
fn arm(v: &[crate::pauses::Phases], kind: AbKind, a: bool) -> Vec<crate::pauses::Phases> {
    v.iter()
        .filter(|p| p.pause_ms > 0.0)
        .filter(|p| match kind {
            AbKind::Method => p.copies_in_pause == a,
            AbKind::Boost => p.boosted == a,
        })
        .copied()
        .collect()
}

/// The arms' names.
fn arm_names(kind: AbKind) -> [&'static str; 2] {
    match kind {
        AbKind::Method => ["by copies", "by btrfs snapshot"],
        AbKind::Boost => ["boosted", "not boosted"],
    }
}

/// One arm's pauses in a window: p50 (p99, or the maximum under 100
/// samples), and n; by boost, its device state and RAM catch-up too.
fn arm_cell(v: &[crate::pauses::Phases], kind: AbKind, a: bool) -> String {
    let picked = arm(v, kind, a);
    let x: Vec<f64> = picked.iter().map(|p| p.pause_ms).collect();
    let s = crate::stats::Summary::of(&x);
    if s.n == 0 {
        return "–".into();
    }
    let mut cell = format!("{} ({}), n={}", fmt_ms(s.p50), p99_cell(&s), s.n);
    if kind == AbKind::Boost {
        cell.push_str(&format!(
            "; device state {}; RAM catch-up {}",
            phase_cell(&picked, |p| p.device_state_ms),
            phase_cell(&picked, |p| p.copy_mem_ms)
        ));
    }
    cell
}

/// A p99 cell: under 100 samples it is the maximum, and says so.
fn p99_cell(s: &crate::stats::Summary) -> String {
    if s.n < 100 {
        format!("{} (max of {})", fmt_ms(s.max), s.n)
    } else {
        fmt_ms(s.p99)
    }
}

/// Runs the section.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: args.mem_mib,
        disk_gib: 2,
    };
    let interval = Duration::from_secs(args.interval_s.max(1));
    let pool_gib = (8 + args.n as u64).max(16);
    let scale = args.retention_scale.max(1);
    let d = BenchDaemon::start(ctx, "strata-bench-soak-", pool_gib, size, |cfg| {
        cfg.snapshot_interval = interval;
        cfg.capacity.vcpus = 0;
        // The soak measures the rolling snapshots of running guests over
        // hours: nothing else may take its guests away. Pressure
        // hibernation and admission by use answer to the host's whole load
        // (a compilation next to the run would hibernate the soak's idle
        // guests), so both step aside: nominal admission with room for all.
        cfg.pressure.enabled = false;
        cfg.vm.guest_disk_flush = args.guest_disk_flush;
        cfg.capacity.admission = stratad::config::AdmissionMode::Nominal;
        cfg.capacity.cpu_overcommit = cfg.capacity.cpu_overcommit.max(args.n as f64);
        if scale > 1 {
            for t in &mut cfg.retention.tiers {
                t.within /= scale;
                t.every /= scale;
            }
        }
    })
    .await?;
    d.rt.set_commit_before_pause(args.commit_before_pause);
    d.rt.set_copies_in_pause(args.copies_in_pause);
    d.rt.set_copies_into_snapshot(args.copies_into_snapshot);
    d.rt.set_pause_boost(args.pause_boost);
    d.rt.set_seal_at_snapshot(args.seal_at_snapshot);
    let pool = d.root.join("data").join("pool");
    let mut ids = Vec::new();
    for i in 0..args.n {
        let (s, v) = d
            .http
            .json(Method::POST, "/v1/sandboxes", Some(json!({})))
            .await?;
        if s != 201 {
            return Err(anyhow!("create #{i}: {s} {v}"));
        }
        let id = v["id"]
            .as_str()
            .ok_or_else(|| anyhow!("no id in {v}"))?
            .to_owned();
        let (code, out) = d
            .http
            .exec_output(&id, &["sh", "-c", WRITER])
            .await
            .map_err(|e| anyhow!("writer in {id}: {e}"))?;
        if code != 0 {
            return Err(anyhow!("writer in {id}: exit {code}: {out}"));
        }
        ids.push(id);
    }
    eprintln!(
        "soak: {} sandboxes, a rolling snapshot every {} s, {} min",
        ids.len(),
        interval.as_secs(),
        args.minutes
    );
    let flipper = (args.ab_secs > 0).then(|| {
        let rt = d.rt.clone();
        let every = Duration::from_secs(args.ab_secs);
        let kind = args.ab_kind;
        tokio::spawn(async move {
            let mut a = true;
            loop {
                match kind {
                    AbKind::Method => rt.set_copies_in_pause(a),
                    AbKind::Boost => rt.set_pause_boost(a),
                }
                tokio::time::sleep(every).await;
                a = !a;
            }
        })
    });
    let start = Instant::now();
    let total = Duration::from_secs(args.minutes * 60);
    let window = Duration::from_secs(args.window_s.max(1));
    let mut windows: Vec<Window> = Vec::new();
    let uuid = pool_uuid(&pool);
    let mut commits_at = commit_stats(uuid.as_deref());
    let mut from = Utc::now();
    crate::pauses::start();
    crate::pauses::take();
    while start.elapsed() < total {
        let left = total.saturating_sub(start.elapsed());
        tokio::time::sleep(window.min(left)).await;
        let to = Utc::now();
        let mut pauses = Samples::new();
        let mut kept = 0;
        let mut unanswered = 0;
        for id in &ids {
            let (p, k) = window_pauses(&d, id, from, to).await?;
            p.into_iter().for_each(|x| pauses.push(x));
            kept += k;
            let alive =
                tokio::time::timeout(Duration::from_secs(30), d.http.exec_output(id, &["true"]))
                    .await;
            if !matches!(alive, Ok(Ok((0, _)))) {
                unanswered += 1;
            }
        }
        let p2 = pool.clone();
        let (pending, (data, meta)) = tokio::task::spawn_blocking(move || {
            Ok::<_, anyhow::Error>((pending_deletions(&p2)?, pool_df(&p2)?))
        })
        .await??;
        let stats = commit_stats(uuid.as_deref());
        let commits = match (commits_at, stats) {
            (Some((c0, ms0)), Some((c1, ms1))) if c1 >= c0 => {
                let n = c1 - c0;
                Some((
                    n,
                    if n > 0 {
                        ms1.saturating_sub(ms0) as f64 / n as f64
                    } else {
                        0.0
                    },
                ))
            }
            _ => None,
        };
        commits_at = stats;
        let w = Window {
            end_min: start.elapsed().as_secs_f64() / 60.0,
            pauses,
            kept,
            pending_deletions: pending,
            data_used: data,
            meta_used: meta,
            rss: rss(),
            unanswered,
            load5: load5(),
            commits,
            phases: crate::pauses::take(),
        };
        let s = w.pauses.summary();
        eprintln!(
            "soak: {:.1} min: {} snapshots, pause p50 {} p99 {}, {} {}, {} {}, RAM catch-up {}, disk copy {}, pool step {}, device state {}, before the pause {}, after the pause {}, kept {}, pending deletions {}, data {}, metadata {}, RSS {}, unanswered {}, load {:.2}, pool commits {}",
            w.end_min,
            s.n,
            fmt_ms(s.p50),
            fmt_ms(s.p99),
            arm_names(args.ab_kind)[0],
            arm_cell(&w.phases, args.ab_kind, true),
            arm_names(args.ab_kind)[1],
            arm_cell(&w.phases, args.ab_kind, false),
            copies_cell(&w.phases, |p| p.copy_mem_ms),
            copies_cell(&w.phases, |p| p.copy_disk_ms),
            phase_cell(&w.phases, |p| p.btrfs_ms),
            phase_cell(&w.phases, |p| p.device_state_ms),
            phase_cell(&w.phases, |p| p.before_pause_ms),
            phase_cell(&w.phases, |p| p.after_pause_ms),
            w.kept,
            w.pending_deletions,
            fmt_bytes(w.data_used as f64),
            fmt_bytes(w.meta_used as f64),
            fmt_bytes(w.rss as f64),
            w.unanswered,
            w.load5,
            commits_cell(w.commits)
        );
        windows.push(w);
        from = to;
    }
    crate::pauses::stop();
    if let Some(f) = flipper {
        f.abort();
        d.rt.set_copies_in_pause(args.copies_in_pause);
        d.rt.set_pause_boost(args.pause_boost);
    }
    let arm_col = arm_names(args.ab_kind).map(|n| format!("pause {n} p50 (p99)"));
    let mut t = Table::new(
        format!(
            "{} sandboxes ({} MiB, 1 vCPU, a writer each), a rolling snapshot every {} s, default retention",
            ids.len(),
            args.mem_mib,
            interval.as_secs()
        ),
        &[
            "window end (min)",
            "snapshots",
            "pause p50",
            "pause p99",
            "pause max",
            "pool step in the pause p50 (p99)",
            "device state p50 (p99)",
            "before the pause p50 (p99)",
            "after the pause p50 (p99)",
            arm_col[0].as_str(),
            arm_col[1].as_str(),
            "RAM catch-up p50 (p99)",
            "disk copy p50 (p99)",
            "kept",
            "pending deletions",
            "pool data",
            "pool metadata",
            "daemon RSS",
            "no answer",
            "load (5 min)",
            "pool commits (mean ms)",
        ],
    );
    for w in &windows {
        let s = w.pauses.summary();
        t.row(vec![
            format!("{:.1}", w.end_min),
            s.n.to_string(),
            fmt_ms(s.p50),
            p99_cell(&s),
            fmt_ms(s.max),
            phase_cell(&w.phases, |p| p.btrfs_ms),
            phase_cell(&w.phases, |p| p.device_state_ms),
            phase_cell(&w.phases, |p| p.before_pause_ms),
            phase_cell(&w.phases, |p| p.after_pause_ms),
            arm_cell(&w.phases, args.ab_kind, true),
            arm_cell(&w.phases, args.ab_kind, false),
            copies_cell(&w.phases, |p| p.copy_mem_ms),
            copies_cell(&w.phases, |p| p.copy_disk_ms),
            w.kept.to_string(),
            w.pending_deletions.to_string(),
            fmt_bytes(w.data_used as f64),
            fmt_bytes(w.meta_used as f64),
            fmt_bytes(w.rss as f64),
            w.unanswered.to_string(),
            format!("{:.2}", w.load5),
            commits_cell(w.commits),
        ]);
    }
    sec.text(
        "**Method.** One daemon, every running sandbox snapshotted on the rolling schedule with the default \
         retention; a writer in each guest so no snapshot is skipped as unchanged. Per window: the pauses of \
         the rolling snapshots taken in it (snapshots API `pause_ms`), what is kept, btrfs subvolumes deleted \
         and not yet cleaned, pool data/metadata (`btrfs filesystem df`), the daemon's RSS (in-process: includes \
         the bench's own few MiB), guests that did not answer `exec true` within 30 s, and the pool's btrfs \
         commits (all of them, with their mean duration: `/sys/fs/btrfs/<uuid>/commit_stats`). Pressure hibernation \
         is off and admission is nominal, so the host's other load cannot hibernate the soak's guests. Bar \
         (issue 18): the last window's pause p99 within 1.2× of the first's.",
    );
    sec.text(if args.copies_in_pause && args.copies_into_snapshot {
        "Paused by copies into the snapshot (`--soak-copies-into-snapshot`, the default): the subvolume is \
         snapshotted before the pause (\"before the pause\"), and in the pause the snapshot's RAM and disk are \
         caught up to the guest's; after `cont` only the device state is put in place and the snapshot signed."
            .to_string()
    } else if args.copies_in_pause {
        "Paused by copies in `.pause/` (`--soak-copies-into-snapshot false`): the pool step in the pause is the \
         catch-up of reflink copies of RAM and disk made before it; the btrfs snapshot and its commit come after `cont` (\"after the pause\"), and \
         no commit of the daemon's runs beside a pause."
            .to_string()
    } else {
        format!(
            "The btrfs snapshot under the pause (`--soak-copies-in-pause false`); the pool's btrfs transaction is \
             {} before each pause (`--soak-commit-before-pause`).",
            if args.commit_before_pause {
                "committed"
            } else {
                "**not** committed"
            }
        )
    });
    sec.text(format!(
        "Pauses boosted: {}. Guests' disk flushes {} (`--soak-guest-disk-flush`). Snapshots made read-only {} (`--soak-seal-at-snapshot`).",
        if args.pause_boost { "yes" } else { "no" },
        if args.guest_disk_flush {
            "passed to the host's disk"
        } else {
            "answered by QEMU"
        },
        if args.seal_at_snapshot {
            "as they are taken, a second commit each"
        } else {
            "only when a send needs it (none here): one commit per snapshot"
        }
    ));
    if scale > 1 {
        sec.text(format!(
            "Retention scaled: the default retention's times divided by {scale} (`--soak-retention-scale`)."
        ));
    }
    sec.table(t);
    if let (Some(first), Some(last)) = (windows.first(), windows.last()) {
        let (a, b) = (first.pauses.summary(), last.pauses.summary());
        sec.headline(format!(
            "soak {:.0} min, {} sandboxes: pause p99 first window {} → last {} ({}); RSS {} → {}; pending deletions at the end {}",
            last.end_min,
            ids.len(),
            fmt_ms(a.p99),
            fmt_ms(b.p99),
            fmt_ratio(b.p99, a.p99),
            fmt_bytes(first.rss as f64),
            fmt_bytes(last.rss as f64),
            last.pending_deletions
        ));
    }
    for id in &ids {
        let _ = d
            .http
            .json(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
    }
    d.stop();
    Ok(())
}
