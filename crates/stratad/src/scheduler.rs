//! Rolling snapshots, idle hibernation and snapshot GC.
//!
//! [`Schedule`] is the pure core: a min-heap of due times holding entries
//! only for sandboxes that can need something (running ones for snapshots,
//! running and paused ones for idle hibernation). It is fed by state changes
//! ([`Schedule::set`]), so its cost grows with the running sandboxes, never
//! with every record in the store. Stale heap entries (from an earlier state)
//! are recognised by a generation number and dropped when they surface.
//!
//! Rolling snapshots are spread over the interval: sandbox `id` is due at
//! times `t` with `t mod interval == phase(id)`, where `phase` is a stable
//! hash of the id. A thousand sandboxes with a 60 s interval snapshot about
//! seventeen per second instead of a thousand at the top of each minute.
//!
//! Activity ([`Schedule::touch`]) only moves a timestamp (O(1)); the idle
//! entry re-checks it when it comes due and re-arms itself if the sandbox
//! was used meanwhile.
//!
//! [`run`] drives a schedule against the wall clock and calls [`Actions`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use strata_core::{SandboxId, SandboxState};
use tokio::sync::{watch, Notify, Semaphore};

use crate::clock::Clock;

/// Something the scheduler wants done.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Task {
    /// Take a rolling snapshot.
    Snapshot(SandboxId),
    /// The sandbox has been idle for its timeout: hibernate it.
    IdleHibernate(SandboxId),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Snapshot,
    Idle,
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    interval_ms: i64,
    idle_ms: i64,
    last_activity_ms: i64,
}

/// Per-sandbox timing of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Rolling snapshot interval (zero: no rolling snapshots).
    pub snapshot_interval: Duration,
    /// Idle timeout (zero: never hibernate for idleness).
    pub idle_timeout: Duration,
}

/// The pure scheduling core. See the module documentation.
#[derive(Debug, Default)]
pub struct Schedule {
    heap: BinaryHeap<Reverse<(i64, u64, Kind, SandboxId)>>,
    entries: HashMap<SandboxId, Entry>,
    next_generation: u64,
    work: u64,
}

/// A stable 64-bit FNV-1a hash (the phase must not change between runs).
fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The offset within each interval at which `id` is snapshotted.
pub fn phase(id: &SandboxId, interval: Duration) -> Duration {
    let i = interval.as_millis().max(1) as u64;
    Duration::from_millis(fnv1a(id.as_str()) % i)
}

/// The first slot of `id` strictly after `now_ms`.
fn next_slot(id: &SandboxId, interval_ms: i64, now_ms: i64) -> i64 {
    let i = interval_ms.max(1);
    let ph = (fnv1a(id.as_str()) % i as u64) as i64;
    // Saturating: an interval of centuries (a stored row from before
    // intervals were bounded) schedules "never", it does not overflow.
    let mut t = (now_ms - now_ms.rem_euclid(i)).saturating_add(ph);
    if t <= now_ms {
        t = t.saturating_add(i);
    }
    t
}

impl Schedule {
    /// An empty schedule.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tells the schedule the (new) state of a sandbox. Replaces whatever
    /// was scheduled for it before.
    pub fn set(
        &mut self,
        id: &SandboxId,
        state: SandboxState,
        timing: Timing,
        last_activity: DateTime<Utc>,
        now: DateTime<Utc>,
    ) {
        let wants_snapshots = state == SandboxState::Running && !timing.snapshot_interval.is_zero();
        let wants_idle = matches!(state, SandboxState::Running | SandboxState::Paused)
            && !timing.idle_timeout.is_zero();
        if !wants_snapshots && !wants_idle {
            self.entries.remove(id);
            return;
        }
        self.next_generation += 1;
        let generation = self.next_generation;
        let entry = Entry {
            generation,
            interval_ms: i64::try_from(timing.snapshot_interval.as_millis()).unwrap_or(i64::MAX),
            idle_ms: i64::try_from(timing.idle_timeout.as_millis()).unwrap_or(i64::MAX),
            last_activity_ms: last_activity.timestamp_millis(),
        };
        let now_ms = now.timestamp_millis();
        if wants_snapshots {
            let due = next_slot(id, entry.interval_ms, now_ms);
            self.heap
                .push(Reverse((due, generation, Kind::Snapshot, id.clone())));
        }
        if wants_idle {
            let due = entry.last_activity_ms.saturating_add(entry.idle_ms);
            self.heap
                .push(Reverse((due, generation, Kind::Idle, id.clone())));
        }
        self.entries.insert(id.clone(), entry);
    }

    /// Forgets a sandbox (deleted, hibernated, failed).
    pub fn remove(&mut self, id: &SandboxId) {
        self.entries.remove(id);
    }

    /// Records activity on a sandbox (O(1)).
    pub fn touch(&mut self, id: &SandboxId, at: DateTime<Utc>) {
        if let Some(e) = self.entries.get_mut(id) {
            e.last_activity_ms = e.last_activity_ms.max(at.timestamp_millis());
        }
    }

    /// Sandboxes with something scheduled.
    pub fn tracked(&self) -> usize {
        self.entries.len()
    }

    /// Heap operations done so far (a cost measure for tests).
    pub fn work(&self) -> u64 {
        self.work
    }

    fn is_current(&self, generation: u64, id: &SandboxId) -> bool {
        self.entries
            .get(id)
            .is_some_and(|e| e.generation == generation)
    }

    /// When the next task is due, if any.
    pub fn next_due(&mut self) -> Option<DateTime<Utc>> {
        while let Some(Reverse((due, generation, _, id))) = self.heap.peek() {
            if self.is_current(*generation, id) {
                return DateTime::from_timestamp_millis(*due);
            }
            self.heap.pop();
            self.work += 1;
        }
        None
    }

    /// Pops every task due at `now` and re-arms the recurring ones.
    pub fn pop_due(&mut self, now: DateTime<Utc>) -> Vec<Task> {
        let now_ms = now.timestamp_millis();
        let mut out = Vec::new();
        while let Some(Reverse((due, _, _, _))) = self.heap.peek() {
            if *due > now_ms {
                break;
            }
            let Some(Reverse((_, generation, kind, id))) = self.heap.pop() else {
                break;
            };
            self.work += 1;
            let Some(e) = self.entries.get(&id).filter(|e| e.generation == generation) else {
                continue;
            };
            match kind {
                Kind::Snapshot => {
                    let next = next_slot(&id, e.interval_ms, now_ms);
                    self.heap
                        .push(Reverse((next, generation, Kind::Snapshot, id.clone())));
                    out.push(Task::Snapshot(id));
                }
                Kind::Idle => {
                    let idle_at = e.last_activity_ms.saturating_add(e.idle_ms);
                    if idle_at <= now_ms {
                        out.push(Task::IdleHibernate(id));
                    } else {
                        self.heap
                            .push(Reverse((idle_at, generation, Kind::Idle, id)));
                    }
                }
            }
        }
        out
    }
}

/// A shared schedule plus a wake-up for its driver.
#[derive(Debug, Clone, Default)]
pub struct SchedulerHandle {
    inner: Arc<Mutex<Schedule>>,
    notify: Arc<Notify>,
}

impl SchedulerHandle {
    /// A handle on an empty schedule.
    pub fn new() -> Self {
        Self::default()
    }

    /// Locks the schedule.
    pub fn lock(&self) -> MutexGuard<'_, Schedule> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Schedule::set`], then wakes the driver.
    pub fn set(
        &self,
        id: &SandboxId,
        state: SandboxState,
        timing: Timing,
        last_activity: DateTime<Utc>,
        now: DateTime<Utc>,
    ) {
        self.lock().set(id, state, timing, last_activity, now);
        self.notify.notify_one();
    }

    /// [`Schedule::remove`].
    pub fn remove(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// [`Schedule::touch`].
    pub fn touch(&self, id: &SandboxId, at: DateTime<Utc>) {
        self.lock().touch(id, at);
    }
}

/// What the driver calls (implemented by the service).
#[async_trait]
pub trait Actions: Send + Sync + 'static {
    /// Takes a rolling snapshot of `id` (then applies retention to it).
    async fn rolling_snapshot(&self, id: SandboxId);
    /// Hibernates an idle sandbox.
    async fn idle_hibernate(&self, id: SandboxId);
    /// Applies retention to every sandbox with snapshots (the slow sweep
    /// that catches hibernated and failed sandboxes whose history ages).
    async fn gc_sweep(&self);
}

/// Driver settings.
#[derive(Debug, Clone, Copy)]
pub struct DriverConfig {
    /// Most tasks run at once (snapshots pause guests and write to disk).
    pub max_concurrent: usize,
    /// Period of the full GC sweep.
    pub sweep_interval: Duration,
}

/// Runs the schedule until `shutdown` turns true.
pub async fn run(
    handle: SchedulerHandle,
    actions: Arc<dyn Actions>,
    clock: Arc<dyn Clock>,
    cfg: DriverConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(cfg.max_concurrent.max(1)));
    let mut next_sweep =
        clock.now() + chrono::Duration::from_std(cfg.sweep_interval).unwrap_or_default();
    loop {
        if *shutdown.borrow() {
            return;
        }
        let now = clock.now();
        let (tasks, next) = {
            let mut s = handle.lock();
            let t = s.pop_due(now);
            (t, s.next_due())
        };
        for task in tasks {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let actions = actions.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match task {
                    Task::Snapshot(id) => actions.rolling_snapshot(id).await,
                    Task::IdleHibernate(id) => actions.idle_hibernate(id).await,
                }
            });
        }
        if now >= next_sweep {
            next_sweep = now + chrono::Duration::from_std(cfg.sweep_interval).unwrap_or_default();
            let actions = actions.clone();
            tokio::spawn(async move { actions.gc_sweep().await });
        }
        // Sleep until the next due time, but re-read the clock at least every
        // second (an injected clock may jump) and wake on state changes.
        let wait = next
            .map(|n| (n - clock.now()).to_std().unwrap_or(Duration::ZERO))
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = handle.notify.notified() => {}
            _ = shutdown.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).single().unwrap()
    }

    fn id(i: usize) -> SandboxId {
        format!("sb-{i:06}").parse().unwrap()
    }

    const MIN: Timing = Timing {
        snapshot_interval: Duration::from_secs(60),
        idle_timeout: Duration::ZERO,
    };

    /// Steps a simulated clock second by second, collecting tasks per second.
    fn run_for(s: &mut Schedule, from: DateTime<Utc>, secs: i64) -> Vec<(i64, Task)> {
        let mut out = Vec::new();
        for sec in 0..secs {
            let now = from + chrono::Duration::seconds(sec);
            for t in s.pop_due(now) {
                out.push((sec, t));
            }
        }
        out
    }

    #[test]
    fn running_sandbox_snapshots_once_per_interval_at_its_phase() {
        let mut s = Schedule::new();
        s.set(&id(1), SandboxState::Running, MIN, t0(), t0());
        let tasks = run_for(&mut s, t0(), 601);
        let ph_ms = phase(&id(1), Duration::from_secs(60)).as_millis() as i64;
        assert_eq!(tasks.len(), if ph_ms == 0 { 11 } else { 10 }, "{tasks:?}");
        // Stepped by whole seconds, a slot at phase p is seen at ceil(p).
        let first = (ph_ms + 999) / 1000;
        for (k, (sec, t)) in tasks.iter().enumerate() {
            assert_eq!(*t, Task::Snapshot(id(1)));
            assert_eq!(*sec, first + 60 * k as i64, "due at its phase");
        }
    }

    #[test]
    fn many_sandboxes_are_spread_over_the_interval() {
        let mut s = Schedule::new();
        for i in 0..1200 {
            s.set(&id(i), SandboxState::Running, MIN, t0(), t0());
        }
        // Seconds 1..=60 see every slot of the first interval exactly once.
        let tasks = run_for(&mut s, t0(), 61);
        assert_eq!(tasks.iter().filter(|(sec, _)| *sec >= 1).count(), 1200);
        let mut per_second = [0usize; 60];
        for (sec, _) in tasks.iter().filter(|(sec, _)| *sec >= 1) {
            per_second[(*sec - 1) as usize] += 1;
        }
        let max = per_second.iter().copied().max().unwrap_or(0);
        // 20 per second on average; a hash spread stays far from 1200.
        assert!(max <= 45, "burst of {max} in one second: {per_second:?}");
        assert!(per_second.iter().filter(|n| **n > 0).count() >= 55);
    }

    #[test]
    fn cost_follows_running_sandboxes_not_all_records() {
        let mut s = Schedule::new();
        for i in 0..10_000 {
            s.set(&id(i), SandboxState::Running, MIN, t0(), t0());
        }
        // 9,990 hibernate: their entries go, only 10 stay scheduled.
        let later = t0() + chrono::Duration::seconds(1);
        for i in 10..10_000 {
            s.set(&id(i), SandboxState::Hibernated, MIN, t0(), later);
        }
        assert_eq!(s.tracked(), 10);
        // The first minute drains the stale entries once...
        run_for(&mut s, t0(), 61);
        let before = s.work();
        // ...after which an hour costs about 10 sandboxes x 60 slots.
        let tasks = run_for(&mut s, t0() + chrono::Duration::seconds(61), 3600);
        let work = s.work() - before;
        assert_eq!(tasks.len(), 600);
        assert!(work <= 620, "work {work}");
    }

    #[test]
    fn paused_and_stopped_sandboxes_take_no_rolling_snapshots() {
        let mut s = Schedule::new();
        for st in [
            SandboxState::Paused,
            SandboxState::Hibernated,
            SandboxState::Failed,
            SandboxState::Deleted,
            SandboxState::Creating,
        ] {
            s.set(&id(1), st, MIN, t0(), t0());
            assert!(run_for(&mut s, t0(), 120).is_empty(), "{st}");
        }
        s.set(&id(1), SandboxState::Running, MIN, t0(), t0());
        s.remove(&id(1));
        assert!(run_for(&mut s, t0(), 120).is_empty());
    }

    #[test]
    fn timings_of_centuries_schedule_nothing_and_do_not_overflow() {
        // Stored rows from before timeouts were bounded (u64 seconds, up to
        // i64::MAX): scheduling them saturates instead of panicking.
        let huge = Duration::from_secs(i64::MAX as u64);
        let mut s = Schedule::new();
        for (i, timing) in [
            Timing {
                snapshot_interval: huge,
                idle_timeout: huge,
            },
            Timing {
                snapshot_interval: Duration::from_secs(10_000_000_000_000),
                idle_timeout: Duration::from_secs(10_000_000_000_000),
            },
        ]
        .into_iter()
        .enumerate()
        {
            s.set(&id(i), SandboxState::Running, timing, t0(), t0());
            s.touch(&id(i), t0() + chrono::Duration::seconds(5));
        }
        assert!(run_for(&mut s, t0(), 120).is_empty());
        let _ = s.next_due();
        assert_eq!(s.tracked(), 2);
    }

    #[test]
    fn idle_sandbox_hibernates_after_timeout_and_activity_postpones_it() {
        let timing = Timing {
            snapshot_interval: Duration::ZERO,
            idle_timeout: Duration::from_secs(300),
        };
        let mut s = Schedule::new();
        s.set(&id(1), SandboxState::Running, timing, t0(), t0());
        // Activity at 200 s pushes the idle deadline to 500 s.
        assert!(run_for(&mut s, t0(), 200).is_empty());
        s.touch(&id(1), t0() + chrono::Duration::seconds(200));
        let tasks = run_for(&mut s, t0() + chrono::Duration::seconds(200), 400);
        assert_eq!(tasks, vec![(300, Task::IdleHibernate(id(1)))]);
        // A paused sandbox idles out too (it holds RAM).
        let mut s = Schedule::new();
        s.set(&id(2), SandboxState::Paused, timing, t0(), t0());
        assert_eq!(run_for(&mut s, t0(), 301).len(), 1);
    }

    #[test]
    fn state_change_replaces_old_schedule() {
        let mut s = Schedule::new();
        s.set(&id(1), SandboxState::Running, MIN, t0(), t0());
        let fast = Timing {
            snapshot_interval: Duration::from_secs(10),
            idle_timeout: Duration::ZERO,
        };
        s.set(&id(1), SandboxState::Running, fast, t0(), t0());
        // Ten minutes at a 10 s interval: 60 slots, none from the old entry.
        let n = run_for(&mut s, t0(), 601).len();
        assert!((60..=61).contains(&n), "old 60 s entry is stale: {n}");
    }

    #[test]
    fn phase_is_stable_and_within_interval() {
        let i = Duration::from_secs(60);
        assert_eq!(phase(&id(7), i), phase(&id(7), i));
        assert!(phase(&id(7), i) < i);
    }

    struct Recorder(Mutex<Vec<Task>>);

    #[async_trait]
    impl Actions for Recorder {
        async fn rolling_snapshot(&self, id: SandboxId) {
            self.0.lock().unwrap().push(Task::Snapshot(id));
        }
        async fn idle_hibernate(&self, id: SandboxId) {
            self.0.lock().unwrap().push(Task::IdleHibernate(id));
        }
        async fn gc_sweep(&self) {}
    }

    #[tokio::test]
    async fn driver_runs_due_tasks_from_an_injected_clock() {
        let clock = Arc::new(crate::clock::ManualClock::new(t0()));
        let handle = SchedulerHandle::new();
        handle.set(&id(1), SandboxState::Running, MIN, t0(), t0());
        let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
        let (tx, rx) = watch::channel(false);
        let cfg = DriverConfig {
            max_concurrent: 2,
            sweep_interval: Duration::from_secs(3600),
        };
        let task = tokio::spawn(run(handle.clone(), rec.clone(), clock.clone(), cfg, rx));
        clock.advance(Duration::from_secs(61));
        handle.notify.notify_one();
        for _ in 0..50 {
            if !rec.0.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(rec.0.lock().unwrap().clone(), vec![Task::Snapshot(id(1))]);
        tx.send(true).unwrap();
        task.await.unwrap();
    }
}
