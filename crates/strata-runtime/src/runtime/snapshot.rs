//! Live snapshots, hibernation, and what snapshots cost.
//!
//! Contract:
//! - A snapshot stops the vCPUs, writes only the device state (RAM is the
//!   `mem` file the guest already runs from), takes one read-only btrfs
//!   snapshot of the sandbox subvolume and continues a VM that was running;
//!   a paused one stays paused. On failure nothing is listed and the VM runs
//!   on.
//! - Nothing new is written when the pool has less than [`MIN_FREE_BYTES`]
//!   free: failing up front beats failing half-way with the VM stopped.
//! - Device state is written to a temporary file and renamed, so a
//!   `device.state` is always whole.
//! - At most `max_concurrent_pauses` guests are stopped by snapshots at once
//!   ([`PauseGate`]); a snapshot waits for its slot with its guest running.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use strata_core::{SandboxId, SnapshotId};
use strata_storage::UsageMethod;

use super::vms::Live;
use super::{blocking, ms, Result, Runtime, StateRef};
use crate::api::{PausePhases, PauseStats, SnapshotInfo, SpaceUsage};
use crate::error::{io_err, storage_err, vmm_err, RuntimeError};
use crate::meta::{files, StateMeta};

/// The host's slots for guests stopped by a snapshot, with the numbers that
/// show the cap holds (`Runtime::pause_stats`).
#[derive(Debug)]
pub(super) struct PauseGate {
    slots: Arc<tokio::sync::Semaphore>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    waited: AtomicU64,
    waited_us: AtomicU64,
}

/// A held slot: counts the pause as in flight until dropped.
pub(super) struct PauseSlot<'a> {
    gate: &'a PauseGate,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for PauseSlot<'_> {
    fn drop(&mut self) {
        self.gate.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PauseGate {
    pub(super) fn new(slots: usize) -> Self {
        PauseGate {
            slots: Arc::new(tokio::sync::Semaphore::new(slots.max(1))),
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            waited: AtomicU64::new(0),
            waited_us: AtomicU64::new(0),
        }
    }

    /// Waits for a slot (the guest still runs meanwhile).
    pub(super) async fn enter(&self) -> Result<PauseSlot<'_>> {
        let t = Instant::now();
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let p = self
                    .slots
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| RuntimeError::Other("pause slots closed".into()))?;
                self.waited.fetch_add(1, Ordering::Relaxed);
                self.waited_us
                    .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                p
            }
        };
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        Ok(PauseSlot {
            gate: self,
            _permit: permit,
        })
    }

    fn stats(&self) -> PauseStats {
        PauseStats {
            in_flight: self.in_flight.load(Ordering::SeqCst),
            peak: self.peak.load(Ordering::SeqCst),
            waited: self.waited.load(Ordering::Relaxed),
            waited_ms: self.waited_us.load(Ordering::Relaxed) as f64 / 1000.0,
        }
    }
}

/// Where a device-state save writes before its file is put in place.
const STATE_TMP: &str = ".device.state.tmp";

/// Where an overlapped pause's device-state save put the state.
enum SavedState {
    /// In the sandbox's `.device.state.tmp`.
    File,
    /// In memory (a direct save): written to `.device.state.tmp` after `cont`.
    Memory(Vec<u8>),
}

/// Where a pause by copies puts its point-in-time copies of the guest's
/// files, inside the sandbox subvolume ([`Runtime::set_copies_in_pause`]).
const PAUSE_COPIES: &str = ".pause";

/// The files the guest changes while it runs: what a pause by copies copies.
const PAUSE_COPIED: [&str; 2] = [files::MEM, files::DISK];

/// QEMU's run state of a guest it stopped on a disk I/O error.
const IO_ERROR: &str = "io-error";

/// Free pool space below which snapshots and new sandboxes are refused (`PoolFull`).
pub const MIN_FREE_BYTES: u64 = 256 << 20;

impl Runtime {
    /// Whether a snapshot of a running guest saves its device state while
    /// the btrfs snapshot is taken (on by default): both need the vCPUs
    /// stopped, neither needs the other, so the pause holds the longer of
    /// the two instead of their sum. The state lands in the sandbox's
    /// `.device.state.tmp` (captured half-written by the btrfs snapshot) and
    /// is put in place in the snapshot after `cont`, before it is signed.
    /// Off: saved first, then snapshotted (how it was; for A/B runs).
    pub fn set_overlapped_state_save(&self, on: bool) {
        self.overlap_save.store(on, Ordering::Relaxed);
    }

    /// Whether a snapshot of a running guest commits the pool's btrfs
    /// transaction after writing back its RAM and before pausing it (on by
    /// default). The btrfs snapshot under the pause commits the transaction
    /// it is made in, and that commit writes every metadata change since the
    /// last one: the file extents of all the data written back meanwhile,
    /// the whole pool's. Once RAM files are fragmented by weeks of
    /// snapshots, that grows with the history (a scratch pool, 1,024 scattered
    /// 4 KiB writes before each snapshot: the snapshot took 350 ms → 1.4 s
    /// over 150 snapshots without the commit, 17–20 ms with it; docs/bench/soak.md).
    /// Committed first, the pause's commit holds only what changed in the
    /// last milliseconds; the commit itself runs while the guest does.
    /// Off: how it was (for A/B runs).
    pub fn set_commit_before_pause(&self, on: bool) {
        self.commit_before_pause.store(on, Ordering::Relaxed);
    }

    /// Whether a snapshot of a running guest pauses it only for reflink
    /// copies of its RAM and disk files (on by default) instead of for the
    /// btrfs snapshot.
    ///
    /// A btrfs snapshot is made inside a transaction commit, and a commit
    /// runs every delayed reference and writes every tree block the whole
    /// pool changed since the last one: other guests' write-back, and the
    /// cleaner dropping what retention deleted. Under a pause, that made a
    /// host that snapshots 20 guests a minute pause them 8 ms at first and
    /// 148 ms (p50) two hours later (docs/bench/soak.md).
    ///
    /// By copies, `mem` and `disk.img` are reflinked into the subvolume's
    /// `.pause/` before the pause (after a write-back and a commit: the
    /// copies' mark), and the guest is stopped for its device-state save
    /// beside the copies' catch-ups (only the ranges written since the
    /// mark; a disk range QEMU punched meanwhile makes the disk's copy
    /// whole: `strata_storage::catchup`). Reflinks add extents to the
    /// running transaction without committing it. After `cont` the
    /// subvolume is snapshotted as before and the copies are cloned over the
    /// snapshot's `mem` and `disk.img` (same inodes: incremental sends still
    /// compare trees), so a snapshot's layout is unchanged and every older
    /// one restores alike. The snapshots' commits after `cont` wait for the
    /// pauses in flight and hold back new ones while they run
    /// (`commit_gate`), so no commit of ours runs beside a pause; btrfs's
    /// own (its 30 s timer, the cleaner) still can.
    ///
    /// Off: the btrfs snapshot under the pause (how it was; for A/B runs).
    pub fn set_copies_in_pause(&self, on: bool) {
        self.copies_in_pause.store(on, Ordering::Relaxed);
    }

    /// Paused by copies ([`Runtime::set_copies_in_pause`]), whether the
    /// copies are the snapshot's own files (on by default): the subvolume is
    /// snapshotted before the pause (its RAM and disk written back first;
    /// the snapshot's commit is the copies' mark) and, in the pause, the
    /// snapshot's `mem` and `disk.img` are caught up to the stopped guest's
    /// (`strata_storage::catchup::begin_snapshot`). After `cont` only the
    /// device state is put in place and the snapshot signed.
    ///
    /// Off: copies in the subvolume's `.pause/`, the snapshot made after
    /// `cont` and the copies cloned over its files. That costs three
    /// whole-file reflinks and their removal per snapshot, each in proportion
    /// to the files' extents (thousands once a RAM file is fragmented), and
    /// a second commit; on a pool snapshotting 20 guests a minute that work
    /// grew with the history until the commits it made slowed the pauses'
    /// catch-ups (docs/bench/soak.md). Kept for A/B runs.
    pub fn set_copies_into_snapshot(&self, on: bool) {
        self.copies_into_snapshot.store(on, Ordering::Relaxed);
    }

    /// Whether a snapshot is made read-only as it is taken (off by
    /// default). Setting a subvolume's read-only flag commits the pool's
    /// btrfs transaction (`BTRFS_IOC_SUBVOL_SETFLAGS` always does, holding
    /// the file system's subvolume lock, so flags set at once do not share
    /// a commit): with it, a snapshot cost two full commits, its
    /// creation's and the flag's, and on a pool snapshotting 20 guests a
    /// minute the flag's was half of the pool's btrfs time
    /// (docs/bench/soak.md).
    ///
    /// Off, a snapshot stays a writable subvolume until something needs it
    /// read-only: a send (move, replication, export) or a parent anchor
    /// seals it first ([`Runtime::seal_snapshot`]), once. Nothing writes
    /// into a published snapshot either way; what guards its contents on
    /// restore is its signature (docs/snapshots.md "Read-only").
    pub fn set_seal_at_snapshot(&self, on: bool) {
        self.seal_at_snapshot.store(on, Ordering::Relaxed);
    }

    /// Makes the subvolume a send of snapshot `snap` would stream (its
    /// received copy, else `snapshots/<snap>`: `sent_form`) read-only if it
    /// is not yet (see [`Runtime::set_seal_at_snapshot`]): one commit, which
    /// waits for the pauses in flight and holds back new ones while it runs.
    /// A no-op for a sealed snapshot.
    pub async fn seal_snapshot(self: &Arc<Self>, snap: &SnapshotId) -> Result<()> {
        let (rt, s) = (self.clone(), snap.clone());
        let (dir, sealed) = blocking(move || {
            let (dir, _) = rt.sent_form(&s)?;
            let sealed = rt.pool.is_readonly(&dir).map_err(storage_err)?;
            Ok((dir, sealed))
        })
        .await?;
        if sealed {
            return Ok(());
        }
        let _exclusive = self.commit_gate.write().await;
        let pool = self.pool.clone();
        blocking(move || seal_dir(&pool, &dir)).await
    }

    /// Writes the device state of a paused VM into `dir/device.state` (atomically).
    pub(super) async fn save_state(
        &self,
        id: &str,
        live: &Live,
        dir: &Path,
    ) -> Result<strata_vmm::SaveStats> {
        let tmp = dir.join(STATE_TMP);
        let stats = match live.vm.save_device_state(&tmp).await {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(vmm_err(id, e));
            }
        };
        std::fs::rename(&tmp, dir.join(files::DEVICE_STATE))
            .map_err(|e| io_err("rename device state", e))?;
        Ok(stats)
    }

    /// The overlapped pause's work (see [`Runtime::set_overlapped_state_save`]):
    /// the device state saved while `dir` is snapshotted into `dst`: into
    /// memory when the VM saves directly (nothing of the pool is written
    /// while the guest is stopped; the bytes go to disk after `cont`), else
    /// into `dir/.device.state.tmp`. The btrfs step's ms, the save's ms,
    /// its figures and where the state is; on failure nothing is left at
    /// `dst`.
    async fn state_beside_btrfs(
        &self,
        id: &str,
        live: &Live,
        dir: &Path,
        dst: &Path,
    ) -> Result<(f64, f64, strata_vmm::SaveStats, SavedState)> {
        let tmp = dir.join(STATE_TMP);
        let pool = self.pool.clone();
        let (src, d) = (dir.to_path_buf(), dst.to_path_buf());
        let btrfs = blocking(move || {
            let t = Instant::now();
            pool.snapshot(&src, &d, false).map_err(storage_err)?;
            Ok(ms(t))
        });
        let save = save_beside(live, &tmp);
        let (btrfs, (saved, save_ms)) = tokio::join!(btrfs, save);
        let err = match (btrfs, saved) {
            (Ok(b), Ok((s, at))) => {
                live.state_saved.store(true, Ordering::SeqCst);
                return Ok((b, save_ms, s, at));
            }
            // No snapshot was made: nothing at `dst`.
            (Err(e), _) => e,
            (Ok(_), Err(e)) => {
                self.discard_unlisted(id, dst, "the snapshot of a failed state save")
                    .await;
                vmm_err(id, e)
            }
        };
        let _ = std::fs::remove_file(&tmp);
        Err(err)
    }

    /// A pause by copies' work (see [`Runtime::set_copies_in_pause`]): the
    /// device state saved (as in [`Runtime::state_beside_btrfs`]) while the
    /// guest's files are reflinked into `dir/.pause/`, which exists and is
    /// empty. The copies' ms, the save's ms, its figures and where the state
    /// is. On failure the caller's `CopiesGuard` removes the copies.
    async fn state_beside_copies(
        &self,
        id: &str,
        live: &Live,
        dir: &Path,
        to: &Path,
        marks: Option<[strata_storage::catchup::Mark; 2]>,
        boosted: bool,
    ) -> Result<(CopyTimes, f64, strata_vmm::SaveStats, SavedState)> {
        let tmp = dir.join(STATE_TMP);
        let pool = self.pool.clone();
        let src = dir.to_path_buf();
        let to = to.to_path_buf();
        let sandbox = id.to_owned();
        let copies = blocking(move || {
            let _nice = boosted.then(|| super::boost::ThreadNice::raise(super::boost::PAUSE_NICE));
            let t = Instant::now();
            let mut times = CopyTimes::default();
            for (i, f) in PAUSE_COPIED.into_iter().enumerate() {
                let tf = Instant::now();
                let from = src.join(f);
                let caught_up = match marks.map(|m| m[i]) {
                    Some(mark) => {
                        match strata_storage::catchup::catch_up(&from, &to.join(f), mark) {
                            Ok(c) => {
                                tracing::debug!(sandbox = %sandbox, file = f, ranges = c.ranges, bytes = c.bytes, whole = c.whole, "copy caught up");
                                true
                            }
                            Err(e) => {
                                tracing::warn!(sandbox = %sandbox, file = f, error = %e, "catching up a copy failed; copying it whole");
                                false
                            }
                        }
                    }
                    None => false,
                };
                if !caught_up && from.exists() {
                    let copy = to.join(f);
                    if copy.exists() {
                        pool.reflink_over(&from, &copy).map_err(storage_err)?;
                    } else {
                        pool.reflink_file(&from, &copy).map_err(storage_err)?;
                    }
                }
                if f == files::MEM {
                    times.mem_ms = ms(tf);
                } else {
                    times.disk_ms = ms(tf);
                }
            }
            times.total_ms = ms(t);
            Ok(times)
        });
        let save = save_beside(live, &tmp);
        let (copies, (saved, save_ms)) = tokio::join!(copies, save);
        let err = match (copies, saved) {
            (Ok(c), Ok((s, at))) => {
                live.state_saved.store(true, Ordering::SeqCst);
                return Ok((c, save_ms, s, at));
            }
            (Err(e), _) => e,
            (Ok(_), Err(e)) => vmm_err(id, e),
        };
        // The copies go with the caller's `CopiesGuard`.
        let _ = std::fs::remove_file(&tmp);
        Err(err)
    }

    /// After a pause by copies: snapshots `dir` into `dst` (with the btrfs
    /// commit, the guest running) and puts the copies over the snapshot's
    /// files. The copies are gone from `dir` either way; on failure nothing
    /// is left at `dst` (the caller's `CopiesGuard` removes the copies if
    /// this fails before it did).
    async fn snapshot_after_copies(&self, id: &str, dir: &Path, dst: &Path) -> Result<f64> {
        let t = Instant::now();
        let (pool, src, d) = (self.pool.clone(), dir.to_path_buf(), dst.to_path_buf());
        let made = {
            let _exclusive = self.commit_gate.write().await;
            blocking(move || {
                pool.snapshot(&src, &d, false).map_err(storage_err)?;
                remove_copies(&src);
                let copies = d.join(PAUSE_COPIES);
                for f in PAUSE_COPIED {
                    let copy = copies.join(f);
                    if copy.exists() {
                        pool.reflink_over(&copy, d.join(f)).map_err(storage_err)?;
                    }
                }
                std::fs::remove_dir_all(&copies)
                    .map_err(|e| io_err("remove the pause's copies from the snapshot", e))
            })
            .await
        };
        if let Err(e) = made {
            if dst.exists() {
                self.discard_unlisted(id, dst, "a snapshot whose copies were not put in place")
                    .await;
            }
            return Err(e);
        }
        Ok(ms(t))
    }

    /// Removes snapshot subvolume `dst` that will never be listed (its
    /// snapshot failed after the btrfs step); a failure to remove it is
    /// logged with `why`, and recovery removes the orphan later.
    async fn discard_unlisted(&self, id: &str, dst: &Path, why: &str) {
        let (pool, d) = (self.pool.clone(), dst.to_path_buf());
        if let Err(t) = blocking(move || pool.trash(&d).map_err(storage_err)).await {
            tracing::warn!(sandbox = %id, snapshot = %dst.display(), error = %t, "removing {why} failed");
        }
    }

    /// After an overlapped pause: the complete device state goes into the
    /// snapshot (over the one of before and the half-written temporary the
    /// btrfs snapshot caught) and becomes the sandbox's own.
    async fn place_state(&self, dir: &Path, dst: &Path, saved: SavedState) -> Result<()> {
        let (dir, dst) = (dir.to_path_buf(), dst.to_path_buf());
        blocking(move || {
            let tmp = dir.join(STATE_TMP);
            if let SavedState::Memory(bytes) = saved {
                std::fs::write(&tmp, bytes)
                    .map_err(|e| io_err("write the device state saved in memory", e))?;
            }
            // A copy within one btrfs file system is a reflink
            // (copy_file_range): no data is written twice.
            std::fs::copy(&tmp, dst.join(files::DEVICE_STATE))
                .map_err(|e| io_err("copy the device state into the snapshot", e))?;
            match std::fs::remove_file(dst.join(STATE_TMP)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove the snapshot's partial device state", e)),
            }
            std::fs::rename(&tmp, dir.join(files::DEVICE_STATE))
                .map_err(|e| io_err("rename device state", e))
        })
        .await
    }

    /// Snapshots a running or paused sandbox as `snap`: stop vCPUs, save device state
    /// only, one read-only btrfs snapshot of RAM + disk + state, continue. A paused
    /// sandbox stays paused. On failure nothing is listed and the VM runs on.
    pub async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let _g = self.op_lock(id.as_str()).await;
        self.snapshot_locked(id, snap).await
    }

    pub(super) async fn snapshot_locked(
        &self,
        id: &SandboxId,
        snap: &SnapshotId,
    ) -> Result<SnapshotInfo> {
        let live = self.live(id)?;
        let dir = self.sandbox_dir(id);
        let dst = self.snapshot_dir(snap);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {snap} already exists"
            )));
        }
        self.check_free_space()?;
        let status = live
            .vm
            .status()
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?;
        let mut was_running = status.running;
        if status.status == IO_ERROR {
            // QEMU stopped the guest on a disk write that found no space
            // (its default `werror=enospc`); the failed write waits in the
            // device. The pool has room again (checked above): continue
            // it, QEMU retries the write, and the snapshot is of a running
            // guest. A save of the stopped guest instead would leave it in
            // `postmigrate`, where no later snapshot can save it.
            tracing::warn!(sandbox = %id, "guest stopped by a disk write with no space left; the pool has room again, continuing it");
            live.resume_vm()
                .await
                .map_err(|e| vmm_err(id.as_str(), e))?;
            was_running = true;
        }
        let mut phases = PausePhases::default();
        let by_copies = was_running && self.copies_in_pause.load(Ordering::Relaxed);
        let into_snapshot = by_copies && self.copies_into_snapshot.load(Ordering::Relaxed);
        phases.copies_in_pause = by_copies;
        phases.copies_into_snapshot = into_snapshot;
        let mut marks = None;
        // Whatever way this returns, no copies stay behind in the sandbox,
        // and a snapshot begun before the pause is not left unlisted.
        let _copies = (by_copies && !into_snapshot).then(|| CopiesGuard(dir.clone()));
        let unlisted = into_snapshot.then(|| UnlistedGuard {
            pool: self.pool.clone(),
            dst: Some(dst.clone()),
        });
        let copies_at = if into_snapshot {
            dst.clone()
        } else {
            dir.join(PAUSE_COPIES)
        };
        if into_snapshot {
            // The snapshot now, the guest running; its RAM and disk are
            // caught up in the pause (`strata_storage::catchup`).
            let pre = Instant::now();
            let (d, s) = (dir.clone(), dst.clone());
            let begun = {
                // The snapshot commits the pool's transaction.
                let _exclusive = self.commit_gate.write().await;
                blocking(move || {
                    strata_storage::catchup::begin_snapshot(&d, &s, &PAUSE_COPIED)
                        .map_err(storage_err)
                })
                .await
            };
            marks = Some(
                <[_; 2]>::try_from(begun?)
                    .map_err(|m| RuntimeError::Other(format!("{} marks for 2 copies", m.len())))?,
            );
            phases.before_pause_ms = ms(pre);
        } else if by_copies {
            // The copies' directory, empty (a crash may have left one).
            let d = dir.clone();
            blocking(move || {
                remove_copies(&d);
                std::fs::create_dir(d.join(PAUSE_COPIES))
                    .map_err(|e| io_err("create the pause's copies directory", e))
            })
            .await?;
            // RAM and disk are copied now, the guest running, and only
            // caught up in the pause (`strata_storage::catchup`): a
            // whole-file reflink costs in proportion to the file's extents,
            // a catch-up to what the guest wrote since (and a disk range
            // QEMU punched meanwhile makes it reflink the disk whole).
            let pre = Instant::now();
            let (root, d) = (self.pool.root().to_path_buf(), dir.clone());
            let begun = {
                // `begin_all` commits the pool's transaction.
                let _exclusive = self.commit_gate.write().await;
                blocking(move || {
                    let (mem, disk) = (d.join(files::MEM), d.join(files::DISK));
                    let to = d.join(PAUSE_COPIES);
                    let (mem_to, disk_to) = (to.join(files::MEM), to.join(files::DISK));
                    strata_storage::catchup::begin_all(
                        &root,
                        &[
                            (mem.as_path(), mem_to.as_path()),
                            (disk.as_path(), disk_to.as_path()),
                        ],
                    )
                    .map_err(storage_err)
                })
                .await
            };
            marks = match begun {
                Ok(m) => <[_; 2]>::try_from(m).ok(),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "copying guest RAM and disk before the pause failed");
                    None
                }
            };
            if marks.is_none() {
                // Copied whole in the pause instead.
                for f in PAUSE_COPIED {
                    let _ = std::fs::remove_file(dir.join(PAUSE_COPIES).join(f));
                }
            }
            phases.before_pause_ms = ms(pre);
        }
        if was_running && !by_copies {
            // Write back the guest RAM the VM dirtied while it still runs:
            // the btrfs snapshot writes back the source's dirty pages, and
            // under the pause that would be all of them, not only those of
            // the last few milliseconds. Best effort: the snapshot is
            // complete either way.
            let mem = dir.join(files::MEM);
            let pre = Instant::now();
            let commit = self
                .commit_before_pause
                .load(Ordering::Relaxed)
                .then(|| self.pool.clone());
            let exclusive = if commit.is_some() {
                Some(self.commit_gate.write().await)
            } else {
                None
            };
            let flushed = blocking(move || {
                std::fs::File::open(&mem)
                    .and_then(|f| f.sync_data())
                    .map_err(|e| RuntimeError::Other(format!("flush guest RAM: {e}")))?;
                // Then the metadata that write-back (and everyone else's)
                // made: see `set_commit_before_pause`.
                if let Some(pool) = commit {
                    pool.commit_transaction().map_err(|e| {
                        RuntimeError::Other(format!("commit before the pause: {e}"))
                    })?;
                }
                Ok(())
            })
            .await;
            drop(exclusive);
            if let Err(e) = flushed {
                tracing::debug!(sandbox = %id, error = %e, "pre-flush before snapshot failed");
            }
            phases.before_pause_ms = ms(pre);
            tracing::debug!(sandbox = %id, ms = phases.before_pause_ms, "guest RAM written back before the pause");
        }
        // A slot before the guest stops: a queue of snapshots waits here with
        // its guests running, not stopped behind each other's commits.
        let slot = if was_running {
            Some(self.pauses.enter().await?)
        } else {
            None
        };
        // No commit of ours starts while the guest is stopped (one in
        // flight is waited for here, the guest running); by btrfs snapshot,
        // the pause's own commit is the only one.
        let shared = if was_running {
            Some(self.commit_gate.read().await)
        } else {
            None
        };
        let mut steps = strata_vmm::SaveSteps::default();
        let mut method = None;
        let mut saved_state = None;
        let mut copy_times = CopyTimes::default();
        // The guest is stopped for the user: its VM and our catch-up run
        // before other guests' work until it runs again (boost.rs).
        let boost = if was_running && self.pause_boost() {
            self.call_boost(id)
        } else {
            None
        };
        phases.boosted = boost.is_some();
        let boosted = phases.boosted;
        let t0 = Instant::now();
        if was_running {
            live.pause_vm().await.map_err(|e| vmm_err(id.as_str(), e))?;
            phases.stop_ms = ms(t0);
        }
        let overlap = was_running && self.overlap_save.load(Ordering::Relaxed);
        let result = async {
            if by_copies {
                let (c, save_ms, st, at) = self
                    .state_beside_copies(id.as_str(), &live, &dir, &copies_at, marks, boosted)
                    .await?;
                copy_times = c;
                let c = c.total_ms;
                steps = st.steps;
                method = Some(st.method);
                saved_state = Some(at);
                return Ok::<(u64, f64, f64), RuntimeError>((st.bytes, save_ms, c));
            }
            if overlap {
                let (b, save_ms, st, at) = self
                    .state_beside_btrfs(id.as_str(), &live, &dir, &dst)
                    .await?;
                steps = st.steps;
                method = Some(st.method);
                saved_state = Some(at);
                return Ok::<(u64, f64, f64), RuntimeError>((st.bytes, save_ms, b));
            }
            let t_state = Instant::now();
            let saved = dir.join(files::DEVICE_STATE);
            let bytes = if !was_running && live.state_saved.load(Ordering::SeqCst) {
                // Stopped since its last save (after a migration QEMU is
                // `postmigrate` and refuses a second one until `cont`):
                // that state is this one.
                std::fs::metadata(&saved)
                    .map_err(|e| io_err("stat the saved device state", e))?
                    .len()
            } else {
                let stats = self.save_state(id.as_str(), &live, &dir).await?;
                live.state_saved.store(true, Ordering::SeqCst);
                steps = stats.steps;
                method = Some(stats.method);
                stats.bytes
            };
            let device_state_ms = ms(t_state);
            let pool = self.pool.clone();
            let (src, d) = (dir.clone(), dst.clone());
            // Writable for now: it is signed and made read-only after `cont`
            // (below), so hashing device.state is not part of the pause. Until
            // then it has no record: a crash in between leaves a subvolume
            // recovery removes as an orphan, never an unsigned snapshot.
            let btrfs_ms = blocking(move || {
                let t = Instant::now();
                pool.snapshot(&src, &d, false).map_err(storage_err)?;
                Ok(ms(t))
            })
            .await?;
            Ok::<(u64, f64, f64), RuntimeError>((bytes, device_state_ms, btrfs_ms))
        }
        .await;
        if was_running {
            let t_cont = Instant::now();
            if let Err(e) = live.resume_vm().await {
                tracing::error!(sandbox = %id, error = %e, "resume after snapshot failed");
                if result.is_ok() {
                    // Reported failed, so not listed: its subvolume goes too
                    // (a QEMU killed between the btrfs snapshot and `cont`
                    // left it in the pool with no record).
                    self.discard_unlisted(id.as_str(), &dst, "the snapshot of a failed resume")
                        .await;
                    if by_copies {
                        let _ = std::fs::remove_file(dir.join(STATE_TMP));
                    }
                    return Err(vmm_err(id.as_str(), e));
                }
            }
            phases.cont_ms = ms(t_cont);
        }
        let pause_ms = ms(t0);
        drop(boost);
        // The guest runs again: the next snapshot's guest may stop (the
        // commits below wait for it through the gate).
        drop(shared);
        drop(slot);
        let (bytes, device_state_ms, btrfs_ms) = result?;
        if by_copies && !into_snapshot {
            match self.snapshot_after_copies(id.as_str(), &dir, &dst).await {
                Ok(v) => phases.after_pause_ms = v,
                Err(e) => {
                    let _ = std::fs::remove_file(dir.join(STATE_TMP));
                    return Err(e);
                }
            }
        }
        if let Some(saved) = saved_state {
            if let Err(e) = self.place_state(&dir, &dst, saved).await {
                self.discard_unlisted(id.as_str(), &dst, "a snapshot without its device state")
                    .await;
                return Err(e);
            }
        }
        // Signed in the snapshot itself (a point-in-time copy: the running
        // guest no longer changes it); read-only now only if so set
        // (`set_seal_at_snapshot`), else when a send first needs it.
        let (pool, d) = (self.pool.clone(), dst.clone());
        let signer = self.cfg.signing.clone();
        let name = snap.to_string();
        let seal = self.seal_at_snapshot.load(Ordering::Relaxed);
        let signed = {
            // The flag's commit waits for the pauses in flight.
            let _exclusive = if seal {
                Some(self.commit_gate.write().await)
            } else {
                None
            };
            blocking(move || {
                let t = Instant::now();
                super::signatures::sign_into(signer.as_deref(), &d, &name, None)?;
                if seal {
                    pool.set_readonly(&d, true).map_err(storage_err)?;
                }
                Ok(ms(t))
            })
            .await
        };
        let sign_ms = match signed {
            Ok(v) => v,
            Err(e) => {
                // Never listed: its subvolume goes (an unsigned snapshot
                // would be refused on restore anyway).
                self.discard_unlisted(id.as_str(), &dst, "an unsigned snapshot")
                    .await;
                return Err(e);
            }
        };
        phases.device_state_ms = device_state_ms;
        phases.device_state_steps = steps;
        phases.device_state_method = method;
        phases.sign_ms = sign_ms;
        phases.btrfs_ms = btrfs_ms;
        phases.copy_mem_ms = copy_times.mem_ms;
        phases.copy_disk_ms = copy_times.disk_ms;
        tracing::info!(
            sandbox = %id, snapshot = %snap, pause_ms, stop_ms = phases.stop_ms,
            device_state_ms, sign_ms, btrfs_ms, cont_ms = phases.cont_ms, bytes,
            before_pause_ms = phases.before_pause_ms,
            after_pause_ms = phases.after_pause_ms, copies_in_pause = by_copies, copies_into_snapshot = into_snapshot,
            boosted = phases.boosted, copy_mem_ms = phases.copy_mem_ms, copy_disk_ms = phases.copy_disk_ms,
            "snapshot taken"
        );
        if let Some(g) = unlisted {
            g.keep();
        }
        Ok(SnapshotInfo {
            id: snap.clone(),
            pause_ms,
            device_state_bytes: bytes,
            created_at: Utc::now(),
            phases,
        })
    }

    /// How the host's pause slots have been used since the runtime opened:
    /// pauses in flight now, the most at once, how many snapshots waited
    /// for a slot and for how long in all.
    pub fn pause_stats(&self) -> PauseStats {
        self.pauses.stats()
    }

    /// Refuses new state when the pool is nearly full: a snapshot writes the guest's
    /// dirty pages and btrfs needs room for metadata; failing up front leaves the
    /// sandbox untouched instead of failing half-way with the VM stopped.
    pub(super) fn check_free_space(&self) -> Result<()> {
        let usage = self.pool.usage().map_err(storage_err)?;
        if usage.free_bytes < MIN_FREE_BYTES {
            tracing::warn!(free = usage.free_bytes, "storage pool is full");
            return Err(RuntimeError::PoolFull);
        }
        Ok(())
    }

    /// Snapshots (as `snap`) and ends the VM process: no CPU, no RAM.
    pub async fn hibernate(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let _g = self.op_lock(id.as_str()).await;
        let live = self.live(id)?;
        let was_running = live.running.load(Ordering::SeqCst);
        live.pause_vm().await.map_err(|e| vmm_err(id.as_str(), e))?;
        let info = match self.snapshot_locked(id, snap).await {
            Ok(i) => i,
            Err(e) => {
                // A guest its owner paused stays paused.
                if was_running {
                    let _ = live.resume_vm().await;
                }
                return Err(e);
            }
        };
        self.stop_vm(id).await;
        let _ = std::fs::remove_dir_all(self.run_dir(id.as_str()));
        Ok(info)
    }

    /// Hibernates without memory (E2B's `pause(keep_memory=False)`): the
    /// guest's file systems are synced and the root frozen (`fsfreeze`, else
    /// a `sync` alone), the vCPUs stopped, `snap` taken as a disk-only state
    /// (no `mem`, no `device.state`; [`StateMeta::disk_only`]) and the VM
    /// ended. A wake from `snap` cold-boots the guest from its disk. On
    /// failure before the VM ends, the guest is thawed and runs on.
    pub async fn hibernate_disk(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let _g = self.op_lock(id.as_str()).await;
        let live = self.live(id)?;
        let dir = self.sandbox_dir(id);
        let dst = self.snapshot_dir(snap);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {snap} already exists"
            )));
        }
        self.check_free_space()?;
        let t0 = Instant::now();
        // A guest its owner paused cannot sync: it runs for the freeze (its
        // memory is dropped by this hibernation anyway: the wake
        // cold-boots) and, should the hibernation fail, is paused again.
        // Before, the freeze's exec waited on the stopped guest for minutes.
        let was_running = live.running.load(Ordering::SeqCst);
        if !was_running {
            live.resume_vm()
                .await
                .map_err(|e| vmm_err(id.as_str(), e))?;
        }
        let as_it_was = || async {
            if !was_running {
                let _ = live.pause_vm().await;
            }
        };
        let agent = match self.agent_of(id, &live).await {
            Ok(a) => a,
            Err(e) => {
                as_it_was().await;
                return Err(e);
            }
        };
        // Frozen: every dirty page is on the disk and the journal is clean;
        // nothing writes to it until the VM ends (or the thaw below).
        let frozen = match agent
            .exec_collect(strata_proto::ExecRequest::shell(
                "sync; if command -v fsfreeze >/dev/null; then fsfreeze -f / && echo frozen; fi",
            ))
            .await
        {
            Ok(out) => {
                out.status.success() && String::from_utf8_lossy(&out.stdout).contains("frozen")
            }
            Err(e) => {
                as_it_was().await;
                return Err(crate::error::agent_err(
                    id.as_str(),
                    e,
                    self.agent_timeout(),
                ));
            }
        };
        let thaw = || async {
            if frozen {
                let _ = agent
                    .exec_collect(strata_proto::ExecRequest::argv(["fsfreeze", "-u", "/"]))
                    .await;
            }
            as_it_was().await;
        };
        if let Err(e) = live.pause_vm().await {
            thaw().await;
            return Err(vmm_err(id.as_str(), e));
        }
        let meta = match StateMeta::read(&dir) {
            Ok(m) => m,
            Err(e) => {
                let _ = live.resume_vm().await;
                thaw().await;
                return Err(RuntimeError::Other(format!("sandbox {id}: {e}")));
            }
        };
        let disk_meta = StateMeta {
            format_version: crate::meta::DISK_ONLY_FORMAT_VERSION,
            disk_only: true,
            first_start: None,
            written_at: Utc::now(),
            ..meta
        };
        let pool = self.pool.clone();
        let (src, d) = (dir.clone(), dst.clone());
        let signer = self.cfg.signing.clone();
        let name = snap.to_string();
        let taken = blocking(move || {
            pool.snapshot(&src, &d, false).map_err(storage_err)?;
            let made = (|| {
                for f in [files::MEM, files::DEVICE_STATE] {
                    match std::fs::remove_file(d.join(f)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_err("remove memory from a disk-only state", e)),
                    }
                }
                disk_meta
                    .write(&d)
                    .map_err(|e| io_err("write meta.json", e))?;
                super::signatures::sign_into(signer.as_deref(), &d, &name, None)?;
                pool.set_readonly(&d, true).map_err(storage_err)
            })();
            if let Err(e) = made {
                let _ = pool.trash(&d);
                return Err(e);
            }
            Ok(())
        })
        .await;
        if let Err(e) = taken {
            let _ = live.resume_vm().await;
            thaw().await;
            return Err(e);
        }
        drop(agent);
        self.stop_vm(id).await;
        let _ = std::fs::remove_dir_all(self.run_dir(id.as_str()));
        let pause_ms = ms(t0);
        tracing::info!(sandbox = %id, snapshot = %snap, pause_ms, frozen, "hibernated without memory");
        Ok(SnapshotInfo {
            id: snap.clone(),
            pause_ms,
            device_state_bytes: 0,
            created_at: Utc::now(),
            phases: Default::default(),
        })
    }

    /// Removes a snapshot. Idempotent.
    pub async fn delete_snapshot(&self, snap: &SnapshotId) -> Result<()> {
        self.trash_if_exists(self.snapshot_dir(snap)).await?;
        self.remove_sidecar(StateRef::Snapshot(snap));
        Ok(())
    }

    /// Metadata of a snapshot.
    pub fn snapshot_meta(&self, snap: &SnapshotId) -> Result<StateMeta> {
        self.open_state(StateRef::Snapshot(snap)).map(|s| s.meta)
    }

    /// Exclusive and referenced bytes of a snapshot (an extent walk: not the hot path).
    pub async fn snapshot_usage(&self, snap: &SnapshotId) -> Result<SpaceUsage> {
        let dir = self.snapshot_dir(snap);
        if !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(snap.to_string()));
        }
        let pool = self.pool.clone();
        blocking(move || {
            let u = pool
                .subvolume_usage(&dir, UsageMethod::Auto)
                .map_err(storage_err)?;
            Ok(SpaceUsage {
                exclusive_bytes: u.exclusive_bytes,
                referenced_bytes: u.referenced_bytes,
            })
        })
        .await
    }
}

/// The device-state save of a pause, beside its pool step: into memory when
/// the VM saves directly (nothing of the pool is written while the guest is
/// stopped), else into `tmp`. With its ms.
async fn save_beside(
    live: &Live,
    tmp: &Path,
) -> (
    std::result::Result<(strata_vmm::SaveStats, SavedState), strata_vmm::VmmError>,
    f64,
) {
    let t = Instant::now();
    let r = match live.vm.save_device_state_in_memory().await {
        Ok(Some((bytes, stats))) => Ok((stats, SavedState::Memory(bytes))),
        Ok(None) => live
            .vm
            .save_device_state(tmp)
            .await
            .map(|stats| (stats, SavedState::File)),
        Err(e) => Err(e),
    };
    (r, ms(t))
}

/// A pause by copies' pool step: in all, the RAM copy's, the disk's (ms).
#[derive(Debug, Clone, Copy, Default)]
struct CopyTimes {
    total_ms: f64,
    mem_ms: f64,
    disk_ms: f64,
}

/// Trashes a snapshot subvolume begun before a pause, never listed, when
/// dropped (the pause failed or its call was dropped); [`UnlistedGuard::keep`]
/// once the snapshot is complete. A crash instead leaves it to recovery,
/// which removes unlisted snapshot subvolumes.
struct UnlistedGuard {
    pool: std::sync::Arc<strata_storage::Pool>,
    dst: Option<std::path::PathBuf>,
}

impl UnlistedGuard {
    fn keep(mut self) {
        self.dst = None;
    }
}

impl Drop for UnlistedGuard {
    fn drop(&mut self) {
        let Some(dst) = self.dst.take() else { return };
        if !dst.exists() {
            return;
        }
        if let Err(e) = self.pool.trash(&dst) {
            tracing::warn!(snapshot = %dst.display(), error = %e, "removing an unfinished snapshot failed");
        }
    }
}

/// Removes a pause's copies from sandbox subvolume `dir` when dropped.
struct CopiesGuard(std::path::PathBuf);

impl Drop for CopiesGuard {
    fn drop(&mut self) {
        remove_copies(&self.0);
    }
}

/// Removes a pause's copies from sandbox subvolume `dir`, if any (unlinking
/// reflinks: metadata only). Best effort: a leftover is removed before the
/// next snapshot of `dir`.
pub(super) fn remove_copies(dir: &Path) {
    let copies = dir.join(PAUSE_COPIES);
    match std::fs::remove_dir_all(&copies) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %copies.display(), error = %e, "removing a pause's copies failed");
        }
    }
}

/// Sets subvolume `dir`'s read-only flag unless it is set (one commit).
/// Blocking.
pub(super) fn seal_dir(pool: &strata_storage::Pool, dir: &Path) -> Result<()> {
    if !pool.is_readonly(dir).map_err(storage_err)? {
        pool.set_readonly(dir, true).map_err(storage_err)?;
        tracing::debug!(path = %dir.display(), "snapshot sealed read-only");
    }
    Ok(())
}
