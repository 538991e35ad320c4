//! Section `move` (opt-in: `strata-bench --only move`): what moving a
//! sandbox's state between two pools costs with incremental
//! `btrfs send -p` / `receive` (`strata_storage::send`, docs/move.md),
//! beside a full send, in the same run.
//!
//! Two real btrfs pools (loop-mounted images) on this host. The sandbox
//! stand-in is a subvolume shaped like a sandbox's (`mem` of
//! `--move-mem-mib`, `disk.img`, `device.state`, `meta.json`) with a
//! history of `--move-history` read-only snapshots, each after
//! `--move-dirty-mib` MiB of guest RAM were rewritten at a random place
//! (what a guest dirties between two rolling snapshots). Cases:
//!
//! - **whole history to an empty remote**: the oldest snapshot in full,
//!   then each next one with the previous as parent (what the first move
//!   of a sandbox sends), against the same history sent as full streams
//!   (measured: the newest snapshot's full stream × the count);
//! - **newest snapshot in full**: one full stream, received;
//! - **one more snapshot, remote holds its parent**: repeated
//!   `--move-reps` times (dirty, snapshot, send incremental, receive):
//!   time p50/p95/p99 and stream bytes against the bytes changed.
//!
//! No guest and no HTTP: the stream goes from `btrfs send` through the
//! receive checker into `btrfs receive` in this process, the path a push
//! takes minus the network. VM hibernate and wake times are measured by
//! the `snapshot` and `restore` sections.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context as _, Result};
use rand::{Rng, SeedableRng};
use strata_storage::testing::TestPool;
use strata_storage::{subvol_info, ReceiveSpec, Uuid};

use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_ratio, Samples};

const MIB: u64 = 1 << 20;

/// Flags of the `move` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "move-args")]
pub struct Args {
    /// Guest RAM file size of the sandbox stand-in, MiB.
    #[arg(id = "move-mem-mib", long = "move-mem-mib", default_value_t = 256)]
    pub mem_mib: u64,
    /// Snapshots in its history.
    #[arg(id = "move-history", long = "move-history", default_value_t = 48)]
    pub history: usize,
    /// RAM rewritten between two snapshots, MiB.
    #[arg(id = "move-dirty-mib", long = "move-dirty-mib", default_value_t = 4)]
    pub dirty_mib: u64,
    /// Repetitions of the one-more-snapshot move.
    #[arg(id = "move-reps", long = "move-reps", default_value_t = 30)]
    pub reps: usize,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.mem_mib = self.mem_mib.min(64);
        self.history = self.history.min(6);
        self.reps = self.reps.min(5);
    }
}

/// Rewrites `mib` MiB of `path` at `offset` with data of `seed`, fsynced.
fn write_at(path: &Path, offset: u64, mib: u64, seed: u64) -> Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..mib {
        for (j, chunk) in buf.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&(seed ^ (i * MIB + j as u64 * 8 + 1)).to_le_bytes());
        }
        f.write_all(&buf)?;
    }
    f.sync_all()?;
    Ok(())
}

/// Sends `snap` (incremental against `parent`) from `a` into `b`'s import
/// directory; (stream bytes, seconds).
fn transfer(
    a: &TestPool,
    b: &TestPool,
    snap: &str,
    parent: Option<&str>,
    recv_name: &str,
) -> Result<(u64, f64)> {
    // The receiver expects the sender's subvolume name.
    let t0 = Instant::now();
    let snap_path = PathBuf::from("snapshots").join(snap);
    let parent_path = parent.map(|p| PathBuf::from("snapshots").join(p));
    let parent_id: Option<Uuid> = match &parent_path {
        Some(p) => Some(subvol_info(&a.root().join(p))?.identity()),
        None => None,
    };
    let mut tx = a.send(&snap_path, parent_path.as_deref())?;
    let spec = ReceiveSpec {
        name: recv_name.into(),
        parent: parent_id,
        max_bytes: u64::MAX,
    };
    let got = b.receive(&spec, &mut tx)?;
    let sent = tx.finish()?;
    if sent != got.bytes {
        return Err(anyhow!("sent {sent} B but received {} B", got.bytes));
    }
    Ok((sent, t0.elapsed().as_secs_f64()))
}

fn measure(args: &Args, sec: &mut Section) -> Result<()> {
    let pool_size = (args.mem_mib * MIB * 3).max(2 << 30);
    let a = TestPool::new(pool_size)?;
    let b = TestPool::new(pool_size)?;
    let sb = a.create_subvolume("sandboxes/sb")?;
    write_at(&sb.join("mem"), 0, args.mem_mib, 1)?;
    write_at(&sb.join("disk.img"), 0, 16, 2)?;
    fs::write(sb.join("device.state"), vec![3u8; 64 << 10])?;
    fs::write(sb.join("meta.json"), b"{\"bench\":true}")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let name = |i: usize| format!("s{i:04}");
    let span = args.mem_mib.saturating_sub(args.dirty_mib).max(1);
    let mut dirty = |i: usize| -> Result<()> {
        let at = rng.gen_range(0..span) * MIB;
        write_at(&sb.join("mem"), at, args.dirty_mib, 100 + i as u64)?;
        fs::write(sb.join("device.state"), vec![i as u8; 64 << 10])?;
        Ok(())
    };
    let history = args.history.max(2);
    a.snapshot(&sb, format!("snapshots/{}", name(0)), true)?;
    for i in 1..history {
        dirty(i)?;
        a.snapshot(&sb, format!("snapshots/{}", name(i)), true)?;
    }

    // Whole history to an empty remote: full oldest, then a chain.
    let t0 = Instant::now();
    let mut chain_bytes = 0;
    for i in 0..history {
        let parent = (i > 0).then(|| name(i - 1));
        let (bytes, _) = transfer(&a, &b, &name(i), parent.as_deref(), &name(i))?;
        chain_bytes += bytes;
    }
    let chain_s = t0.elapsed().as_secs_f64();

    // The newest snapshot in full, into a third pool (a stream keeps its
    // subvolume's name; deleted after each run).
    let c = TestPool::new(pool_size)?;
    let mut full_t = Samples::new();
    let mut full_bytes = 0;
    for _ in 0..3 {
        let newest = name(history - 1);
        let (bytes, s) = transfer(&a, &c, &newest, None, &newest)?;
        full_bytes = bytes;
        full_t.push(s * 1000.0);
        c.delete_received(&newest)?;
    }
    drop(c);
    let full_sum = full_t.summary();

    // One more snapshot at a time, the remote holding its parent.
    let mut inc_t = Samples::new();
    let mut inc_b = Samples::new();
    for r in 0..args.reps {
        let i = history + r;
        dirty(i)?;
        a.snapshot(&sb, format!("snapshots/{}", name(i)), true)?;
        let (bytes, s) = transfer(&a, &b, &name(i), Some(&name(i - 1)), &name(i))?;
        inc_t.push(s * 1000.0);
        inc_b.push(bytes as f64);
    }
    let inc_sum = inc_t.summary();
    let inc_bytes = inc_b.summary();
    // What the stand-in holds (RAM, disk, device state) and what changed
    // between two snapshots (rewritten RAM and device state).
    let state_bytes = ((args.mem_mib + 16) * MIB) as f64 + (64 << 10) as f64;
    let changed = (args.dirty_mib * MIB) as f64 + (64 << 10) as f64;

    let mut t = Table::new(
        format!(
            "Whole history of {history} snapshots ({} MiB RAM, {} MiB rewritten between snapshots) to an empty remote",
            args.mem_mib, args.dirty_mib
        ),
        &["case", "stream bytes", "time", "vs full streams"],
    );
    t.row(vec![
        "full oldest + incremental chain".into(),
        fmt_bytes(chain_bytes as f64),
        fmt_ms(chain_s * 1000.0),
        fmt_ratio(chain_bytes as f64, full_bytes as f64 * history as f64),
    ]);
    t.row(vec![
        format!("{history} full streams (newest's size × {history})"),
        fmt_bytes(full_bytes as f64 * history as f64),
        fmt_ms(full_sum.p50 * history as f64),
        "1×".into(),
    ]);
    sec.table(t);
    let mut t = Table::latency(
        "One snapshot moved: in full, and incrementally when the remote holds its parent",
        &[
            "stream bytes p50",
            "bytes to move",
            "stream / bytes to move",
        ],
    );
    t.latency_row(
        "newest snapshot, full stream (whole state)",
        &full_sum,
        vec![
            fmt_bytes(full_bytes as f64),
            fmt_bytes(state_bytes),
            fmt_ratio(full_bytes as f64, state_bytes),
        ],
    );
    t.latency_row(
        "one more snapshot, incremental (-p parent; bytes changed)",
        &inc_sum,
        vec![
            fmt_bytes(inc_bytes.p50),
            fmt_bytes(changed),
            fmt_ratio(inc_bytes.max, changed),
        ],
    );
    sec.table(t);
    sec.headline(format!(
        "move: one more snapshot of a {} MiB sandbox sends {} ({} of the bytes changed, max over {} runs) in {} p50 / {} p99, vs {} in {} for a full send",
        args.mem_mib,
        fmt_bytes(inc_bytes.p50),
        fmt_ratio(inc_bytes.max, changed),
        inc_sum.n,
        fmt_ms(inc_sum.p50),
        fmt_ms(inc_sum.p99),
        fmt_bytes(full_bytes as f64),
        fmt_ms(full_sum.p50),
    ));
    sec.data = serde_json::json!({
        "mem_mib": args.mem_mib,
        "history": history,
        "dirty_mib": args.dirty_mib,
        "chain_bytes": chain_bytes,
        "chain_s": chain_s,
        "full_bytes": full_bytes,
        "full_ms": full_t.0,
        "incremental_ms": inc_t.0,
        "incremental_bytes": inc_b.0,
        "changed_bytes": changed,
    });
    Ok(())
}

/// Runs the section.
pub async fn run(_ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let args = args.clone();
    let mut out = Section::new(&sec.key, sec.title.clone());
    let (res, out) = tokio::task::spawn_blocking(move || {
        let r = measure(&args, &mut out);
        (r, out)
    })
    .await?;
    sec.blocks = out.blocks;
    sec.headline = out.headline;
    sec.data = out.data;
    res
}
