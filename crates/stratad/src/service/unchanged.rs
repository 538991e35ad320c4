//! Rolling snapshots of unchanged guests (issue 19, idle cost): a rolling
//! snapshot of a guest where nothing happened since its previous snapshot
//! is recorded without being taken (no pause, no subvolume), as a `same_as`
//! record naming that snapshot ([`SnapshotRecord::same_as`]).
//!
//! A guest is unchanged since the snapshot this module keeps a
//! [`Baseline`] of (the last real rolling or manual snapshot of its present
//! VM process) when all of these hold ([`decide`], pure):
//! 1. that snapshot is still the sandbox's latest ready one (or the latest
//!    is a `same_as` record of it): nothing else (a fork, a rewind) was
//!    snapshotted since;
//! 2. the root disk's write counters (QMP `query-blockstats`: writes and
//!    discards, [`Engine::disk_writes`]) are what they were just before it
//!    was taken, in the same QEMU process (a restore or a wake starts a new
//!    one: the first rolling snapshot after it is real);
//! 3. no activity reached the sandbox since: no API call on it
//!    ([`Service::touch`]), no port traffic, no egress connection or byte
//!    ([`ActivityNote`], cheap: one atomic per event);
//! 4. the sampler's peak CPU of the sandbox since then is under
//!    `[snapshots] unchanged_max_cpu_pct` (1 % by default); no sample is
//!    unknown, and unknown is "changed".
//!
//! What it does not see: a guest changing its memory with little CPU and
//! no I/O (a timer-driven process writing a few pages). Restoring the
//! earlier snapshot then loses those pages; `skip_unchanged = false` turns
//! the whole thing off.
//!
//! Every record points at a real snapshot, never at another `same_as`
//! record. Retention keeps a target while a kept record points at it
//! (`crate::retention::spare_targets`); a user's delete of a target deletes
//! the records pointing at it with it. So no record ever names a snapshot
//! that is gone.

use std::sync::atomic::{AtomicI64, Ordering};

use super::prelude::*;
use crate::engine::DiskWrites;

/// Metric counted (`strata_events_total{kind=…}`) for each rolling snapshot
/// recorded as the same as an earlier one.
pub const SKIPPED_METRIC: &str = "snapshot_unchanged_skipped";

/// What the daemon saw when it took a real snapshot of a running guest.
#[derive(Debug, Clone, PartialEq)]
pub struct Baseline {
    /// The snapshot.
    pub snapshot: SnapshotId,
    /// When the counters were read (just before the snapshot paused the
    /// guest): activity or CPU at or after it counts as change.
    pub at: DateTime<Utc>,
    /// The disk's write counters then, and the QEMU process they are of.
    pub disk: DiskWrites,
}

/// What [`decide`] looks at.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// The baseline kept for the sandbox, if any.
    pub baseline: Option<&'a Baseline>,
    /// The sandbox's latest ready snapshot: its id and, when it is a
    /// `same_as` record, the snapshot it names.
    pub latest: Option<(&'a SnapshotId, Option<&'a SnapshotId>)>,
    /// The disk's write counters now (`None`: the engine cannot tell).
    pub disk: Option<DiskWrites>,
    /// The sandbox's last activity (API call, port or egress traffic).
    pub last_activity: Option<DateTime<Utc>>,
    /// The sampler's peak CPU since the baseline (`None`: no samples).
    pub peak_cpu_pct: Option<f64>,
    /// Peak CPU under which a guest counts as idle, in percent.
    pub max_cpu_pct: f64,
}

/// Why a guest counts as changed: the rolling snapshot is taken.
#[derive(Debug, Clone, PartialEq)]
pub enum Changed {
    /// No baseline: the first snapshot of this VM process (or of this daemon).
    NoBaseline,
    /// Another snapshot is the latest one now (a fork, a rewind, a wake).
    OtherSnapshot,
    /// The engine cannot read the disk's write counters.
    NoCounters,
    /// A new VM process (a restore or a wake): its counters restarted.
    NewProcess,
    /// The guest wrote to (or discarded on) its disk.
    DiskWritten {
        /// Write requests since the baseline.
        operations: u64,
        /// Bytes written since the baseline.
        bytes: u64,
    },
    /// Something reached the sandbox since the baseline.
    Activity(DateTime<Utc>),
    /// No CPU sample since the baseline: idleness unknown.
    NoSamples,
    /// The guest used the CPU.
    Busy(f64),
}

impl std::fmt::Display for Changed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Changed::NoBaseline => write!(f, "no counters kept for this VM process yet"),
            Changed::OtherSnapshot => write!(f, "another snapshot was taken since"),
            Changed::NoCounters => write!(f, "disk write counters unknown"),
            Changed::NewProcess => write!(f, "a new VM process since"),
            Changed::DiskWritten { operations, bytes } => {
                write!(f, "disk written ({operations} requests, {bytes} bytes)")
            }
            Changed::Activity(at) => write!(f, "activity at {}", at.to_rfc3339()),
            Changed::NoSamples => write!(f, "no CPU sample since"),
            Changed::Busy(p) => write!(f, "peak CPU {p:.2} %"),
        }
    }
}

/// A guest found unchanged: record the rolling snapshot as `same_as` `target`.
#[derive(Debug, Clone, PartialEq)]
pub struct Same {
    /// The real snapshot the guest is still at.
    pub target: SnapshotId,
    /// Why, for the journal: what was compared.
    pub why: String,
}

/// Whether a rolling snapshot can be recorded as the same as the
/// baseline's snapshot (see the module documentation). Pure.
pub fn decide(i: &Inputs<'_>) -> Result<Same, Changed> {
    let b = i.baseline.ok_or(Changed::NoBaseline)?;
    match i.latest {
        Some((id, None)) if *id == b.snapshot => {}
        Some((_, Some(target))) if *target == b.snapshot => {}
        _ => return Err(Changed::OtherSnapshot),
    }
    let now = i.disk.ok_or(Changed::NoCounters)?;
    if now.pid != b.disk.pid {
        return Err(Changed::NewProcess);
    }
    if now.writes != b.disk.writes {
        let (n, o) = (now.writes, b.disk.writes);
        return Err(Changed::DiskWritten {
            operations: (n.wr_operations + n.unmap_operations)
                .saturating_sub(o.wr_operations + o.unmap_operations),
            bytes: (n.wr_bytes + n.unmap_bytes).saturating_sub(o.wr_bytes + o.unmap_bytes),
        });
    }
    if let Some(at) = i.last_activity.filter(|at| *at >= b.at) {
        return Err(Changed::Activity(at));
    }
    let peak = i.peak_cpu_pct.ok_or(Changed::NoSamples)?;
    if peak.is_nan() || peak >= i.max_cpu_pct {
        return Err(Changed::Busy(peak));
    }
    Ok(Same {
        target: b.snapshot.clone(),
        why: format!(
            "unchanged since {} ({}): disk not written ({} write requests in this VM), no activity, peak CPU {peak:.2} % < {} %",
            b.snapshot,
            b.at.to_rfc3339(),
            now.writes.wr_operations,
            i.max_cpu_pct
        ),
    })
}

/// Records activity of one sandbox from a hot path (every egress or port
/// read and write): one clock read and one atomic.
#[derive(Clone)]
pub struct ActivityNote {
    last_ms: Arc<AtomicI64>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for ActivityNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivityNote")
            .field("last_ms", &self.last_ms.load(Ordering::Relaxed))
            .finish()
    }
}

impl ActivityNote {
    /// Something reached the sandbox now.
    pub fn note(&self) {
        self.last_ms
            .fetch_max(self.clock.now().timestamp_millis(), Ordering::Relaxed);
    }
}

/// What the service keeps per sandbox for the decision (in memory only: a
/// daemon restart starts without baselines, so its first rolling snapshot
/// of each guest is real).
#[derive(Default)]
pub(super) struct Tracker {
    baselines: Mutex<HashMap<SandboxId, Baseline>>,
    activity: Mutex<HashMap<SandboxId, Arc<AtomicI64>>>,
}

impl Tracker {
    fn cell(&self, id: &SandboxId) -> Arc<AtomicI64> {
        self.activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.clone())
            .or_insert_with(|| Arc::new(AtomicI64::new(i64::MIN)))
            .clone()
    }

    pub(super) fn touch(&self, id: &SandboxId, at: DateTime<Utc>) {
        self.cell(id)
            .fetch_max(at.timestamp_millis(), Ordering::Relaxed);
    }

    fn last_activity(&self, id: &SandboxId) -> Option<DateTime<Utc>> {
        let ms = self
            .activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)?
            .load(Ordering::Relaxed);
        (ms != i64::MIN)
            .then(|| DateTime::from_timestamp_millis(ms))
            .flatten()
    }

    fn baseline(&self, id: &SandboxId) -> Option<Baseline> {
        self.baselines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    fn set_baseline(&self, id: &SandboxId, b: Option<Baseline>) {
        let mut g = self.baselines.lock().unwrap_or_else(|p| p.into_inner());
        match b {
            Some(b) => g.insert(id.clone(), b),
            None => g.remove(id),
        };
    }

    pub(super) fn forget(&self, id: &SandboxId) {
        self.set_baseline(id, None);
        self.activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// The counters read before a real snapshot, kept once it is ready.
#[derive(Debug, Clone)]
pub(super) struct Before {
    at: DateTime<Utc>,
    disk: Option<DiskWrites>,
}

impl Service {
    /// An [`ActivityNote`] of sandbox `id`, for the egress and port paths.
    pub fn activity_note(&self, id: &SandboxId) -> ActivityNote {
        ActivityNote {
            last_ms: self.unchanged.cell(id),
            clock: self.clock.clone(),
        }
    }

    /// Whether the rolling snapshot about to be taken of running sandbox
    /// `id` can be a `same_as` record instead, and of what.
    pub(super) async fn unchanged_since(&self, id: &SandboxId) -> Result<Same, Changed> {
        let baseline = self.unchanged.baseline(id);
        let Some(b) = baseline.as_ref() else {
            return Err(Changed::NoBaseline);
        };
        let id2 = id.clone();
        let latest = self
            .db(move |s| s.latest_ready_snapshot(&id2))
            .await
            .ok()
            .flatten();
        let disk = self.engine.disk_writes(id).await.ok().flatten();
        decide(&Inputs {
            baseline: Some(b),
            latest: latest.as_ref().map(|l| (&l.id, l.same_as.as_ref())),
            disk,
            last_activity: self.unchanged.last_activity(id),
            peak_cpu_pct: self.sampler.peak_cpu_pct(id, b.at),
            max_cpu_pct: self.config.snapshots.unchanged_max_cpu_pct,
        })
    }

    /// Reads what a real snapshot of `id` is compared against later; call
    /// just before taking it (writes between this and the pause make the
    /// next snapshot real: the safe side).
    pub(super) async fn before_snapshot(&self, id: &SandboxId) -> Before {
        let at = self.now();
        let disk = if self.config.snapshots.skip_unchanged {
            self.engine.disk_writes(id).await.ok().flatten()
        } else {
            None
        };
        Before { at, disk }
    }

    /// Keeps (or, without counters, drops) the baseline of `id` after its
    /// real snapshot `snap` is ready.
    pub(super) fn after_snapshot(&self, id: &SandboxId, snap: &SnapshotId, before: Before) {
        let b = before.disk.map(|disk| Baseline {
            snapshot: snap.clone(),
            at: before.at,
            disk,
        });
        self.unchanged.set_baseline(id, b);
    }

    /// The snapshot a record stands for: itself, or the real snapshot a
    /// `same_as` record names (which must be ready).
    pub(super) async fn resolve_same_as(
        &self,
        rec: SnapshotRecord,
    ) -> ServiceResult<SnapshotRecord> {
        let Some(target) = rec.same_as.clone() else {
            return Ok(rec);
        };
        let t2 = target.clone();
        match self.db(move |s| s.get_snapshot(&t2)).await? {
            Some(t) if t.status == SnapshotStatus::Ready && t.same_as.is_none() => Ok(t),
            _ => Err(ServiceError::InvalidStateOther(format!(
                "snapshot {} is the same as {target}, which is gone",
                rec.id
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use strata_vmm::BlockWrites;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).single().unwrap()
    }

    fn sid(s: &str) -> SnapshotId {
        s.parse().unwrap()
    }

    fn disk(pid: u32, ops: u64) -> DiskWrites {
        DiskWrites {
            pid,
            writes: BlockWrites {
                wr_operations: ops,
                wr_bytes: ops * 4096,
                unmap_operations: 0,
                unmap_bytes: 0,
            },
        }
    }

    fn baseline() -> Baseline {
        Baseline {
            snapshot: sid("snap-a"),
            at: t0(),
            disk: disk(100, 7),
        }
    }

    /// An idle guest: every input says unchanged.
    fn idle<'a>(b: &'a Baseline, latest: &'a SnapshotId) -> Inputs<'a> {
        Inputs {
            baseline: Some(b),
            latest: Some((latest, None)),
            disk: Some(disk(100, 7)),
            last_activity: Some(t0() - chrono::TimeDelta::seconds(5)),
            peak_cpu_pct: Some(0.4),
            max_cpu_pct: 1.0,
        }
    }

    #[test]
    fn an_idle_guest_is_the_same_as_its_baseline() {
        let b = baseline();
        let a = sid("snap-a");
        let same = decide(&idle(&b, &a)).expect("unchanged");
        assert_eq!(same.target, a);
        assert!(same.why.contains("unchanged since snap-a"), "{}", same.why);
        assert!(same.why.contains("peak CPU 0.40 %"), "{}", same.why);
        // Latest is a same_as record of the baseline: still the same (no chain).
        let later = sid("snap-b");
        let mut i = idle(&b, &later);
        i.latest = Some((&later, Some(&a)));
        assert_eq!(decide(&i).map(|s| s.target), Ok(a.clone()));
        // No activity recorded at all is no activity.
        let mut i = idle(&b, &a);
        i.last_activity = None;
        assert!(decide(&i).is_ok());
    }

    #[test]
    fn disk_writes_make_it_changed() {
        let b = baseline();
        let a = sid("snap-a");
        let mut i = idle(&b, &a);
        i.disk = Some(disk(100, 9));
        assert_eq!(
            decide(&i),
            Err(Changed::DiskWritten {
                operations: 2,
                bytes: 8192
            })
        );
        // A discard alone (fstrim) changes the disk too.
        let mut d = disk(100, 7);
        d.writes.unmap_operations = 1;
        i.disk = Some(d);
        assert!(matches!(decide(&i), Err(Changed::DiskWritten { .. })));
        // Counters unknown: changed.
        i.disk = None;
        assert_eq!(decide(&i), Err(Changed::NoCounters));
        // Another QEMU process (a restore): its counters mean nothing here,
        // even equal ones.
        i.disk = Some(disk(101, 7));
        assert_eq!(decide(&i), Err(Changed::NewProcess));
    }

    #[test]
    fn activity_since_the_baseline_makes_it_changed() {
        let b = baseline();
        let a = sid("snap-a");
        let mut i = idle(&b, &a);
        let at = t0() + chrono::TimeDelta::milliseconds(1);
        i.last_activity = Some(at);
        assert_eq!(decide(&i), Err(Changed::Activity(at)));
        // At the very instant the counters were read: changed (safe side).
        i.last_activity = Some(t0());
        assert_eq!(decide(&i), Err(Changed::Activity(t0())));
    }

    #[test]
    fn cpu_at_or_over_the_threshold_or_unknown_makes_it_changed() {
        let b = baseline();
        let a = sid("snap-a");
        let mut i = idle(&b, &a);
        i.peak_cpu_pct = Some(1.0);
        assert_eq!(decide(&i), Err(Changed::Busy(1.0)));
        i.peak_cpu_pct = Some(37.5);
        assert_eq!(decide(&i), Err(Changed::Busy(37.5)));
        i.peak_cpu_pct = None;
        assert_eq!(decide(&i), Err(Changed::NoSamples));
        i.peak_cpu_pct = Some(f64::NAN);
        assert!(matches!(decide(&i), Err(Changed::Busy(_))));
        // A higher threshold (a TCG host) lets the same peak through.
        i.peak_cpu_pct = Some(3.0);
        i.max_cpu_pct = 5.0;
        assert!(decide(&i).is_ok());
    }

    #[test]
    fn without_a_baseline_or_after_another_snapshot_it_is_taken() {
        let b = baseline();
        let a = sid("snap-a");
        let mut i = idle(&b, &a);
        i.baseline = None;
        assert_eq!(decide(&i), Err(Changed::NoBaseline));
        // A fork or rewind snapshot came after the baseline.
        let other = sid("snap-z");
        let i = idle(&b, &other);
        assert_eq!(decide(&i), Err(Changed::OtherSnapshot));
        // A same_as record of some other snapshot.
        let mut i = idle(&b, &other);
        let y = sid("snap-y");
        i.latest = Some((&other, Some(&y)));
        assert_eq!(decide(&i), Err(Changed::OtherSnapshot));
        // No ready snapshot at all.
        let mut i = idle(&b, &a);
        i.latest = None;
        assert_eq!(decide(&i), Err(Changed::OtherSnapshot));
    }

    #[test]
    fn activity_notes_only_move_forward() {
        let t = Tracker::default();
        let id: SandboxId = "sb-one".parse().unwrap();
        assert_eq!(t.last_activity(&id), None);
        t.touch(&id, t0() + chrono::TimeDelta::seconds(10));
        t.touch(&id, t0());
        assert_eq!(
            t.last_activity(&id),
            Some(t0() + chrono::TimeDelta::seconds(10))
        );
        t.forget(&id);
        assert_eq!(t.last_activity(&id), None);
    }
}
