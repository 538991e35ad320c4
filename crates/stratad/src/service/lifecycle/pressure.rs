//! Pressure-driven hibernation: when the host runs short, idle sandboxes
//! hibernate before anything is refused.
//!
//! Two callers decide with the same rules:
//! - **the monitor** ([`Service::spawn_pressure`]) reads the host's
//!   pressure stall information every `[pressure] interval`: the share of
//!   that interval some task waited for a CPU, or stalled on memory
//!   (`/proc/pressure/{cpu,memory}`, from the cumulative counters, so it is
//!   the last interval's figure, not the kernel's lagging 10-second
//!   average), and whether `MemAvailable` fell under `[capacity]
//!   memory_headroom`. After `sustain` readings in a row over a threshold,
//!   warm guests end (all of them: a pool is a guess, a sandbox is
//!   someone's), then one idle sandbox hibernates every `step` while the
//!   pressure lasts; the warm-pool filler waits while it does.
//! - **admission** (`service::admission`): a create, fork or wake that does
//!   not fit hibernates idle sandboxes, one at a time, until it fits or no
//!   sandbox is idle; only then is it refused.
//!
//! **Idle** means: running or paused, no operation pending or holding its
//! lock, no call in flight on its agent connection (exec, file transfer,
//! watch, egress or port tunnel — [`Engine::open_calls`], asked again once
//! its lock is held), no activity for `[pressure] min_idle`, and a
//! lifecycle policy that wakes it on use (`auto_resume`), so its next exec,
//! file call or port connection wakes it with its memory. The least
//! recently active goes first. The idle timeout stays the upper bound: a
//! sandbox idle for its timeout hibernates (or is deleted) as before.
//!
//! What it does not do: it never deletes anything, never hibernates a
//! sandbox someone is using, and cannot tell a guest that computes without
//! any call from one that idles — a guest busy on its own for longer than
//! `min_idle` counts as idle and is hibernated (memory kept, so the work
//! continues at its wake).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::watch;

use super::super::prelude::*;
use crate::host::{HostReader, HostSample};

/// Event counted for every hibernation made for pressure (`/metrics`
/// `strata_events_total{kind="pressure_hibernation"}`).
pub const PRESSURE_HIBERNATION: &str = "pressure_hibernation";

/// What [`Service::hibernate_one_idle`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Freed {
    /// This sandbox hibernated: its room is free.
    Hibernated(SandboxId),
    /// Nothing hibernated now, but room is on its way: a hibernation is
    /// under way, or an idle sandbox is busy with a background operation
    /// for a moment.
    Pending,
    /// No sandbox is idle.
    Nothing,
}

/// Whether a sandbox is idle at `now` (module documentation): running or
/// paused, no operation pending, unused for `min_idle`, and no call in
/// flight on its agent connection (`open_calls`, asked last and only when
/// the rest holds; `None`, an engine that cannot tell, is never idle).
pub(crate) fn is_idle(
    state: SandboxState,
    pending: bool,
    last_used: DateTime<Utc>,
    now: DateTime<Utc>,
    min_idle: chrono::TimeDelta,
    open_calls: impl FnOnce() -> Option<u32>,
) -> bool {
    matches!(state, SandboxState::Running | SandboxState::Paused)
        && !pending
        && now - last_used >= min_idle
        && open_calls() == Some(0)
}

/// One sandbox holding room, as the choice of the idle ones sees it.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    /// The sandbox.
    pub id: SandboxId,
    /// Its state.
    pub state: SandboxState,
    /// Whether an operation is pending on it.
    pub pending: bool,
    /// When it was last used.
    pub last_used: DateTime<Utc>,
}

/// The idle ones of `candidates` not in `exclude`, the least recently
/// used first (ties by id, so the order is stable): the order in which
/// pressure and admission hibernate them. `open_calls` is asked only of a
/// sandbox idle by every other rule.
pub(crate) fn idle_order(
    candidates: impl IntoIterator<Item = Candidate>,
    exclude: &[SandboxId],
    now: DateTime<Utc>,
    min_idle: chrono::TimeDelta,
    open_calls: impl Fn(&SandboxId) -> Option<u32>,
) -> Vec<(SandboxId, DateTime<Utc>)> {
    let mut out: Vec<(SandboxId, DateTime<Utc>)> = candidates
        .into_iter()
        .filter(|c| {
            !exclude.contains(&c.id)
                && is_idle(c.state, c.pending, c.last_used, now, min_idle, || {
                    open_calls(&c.id)
                })
        })
        .map(|c| (c.id, c.last_used))
        .collect();
    out.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// What the pressure monitor does after a reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Nothing: no sustained pressure, or the last action was less than
    /// `step` ago.
    Wait,
    /// End the warm guests (all of them): a pool is a guess, a sandbox is
    /// someone's.
    EndWarm,
    /// Hibernate the least recently used idle sandbox.
    HibernateIdle,
}

/// The monitor's next [`Action`]: `active` is pressure sustained for
/// `[pressure] sustain` readings, `since_last` the time since its last
/// action (`None`: none yet), `warm_ready` the warm guests ready now.
pub(crate) fn next_action(
    active: bool,
    since_last: Option<Duration>,
    step: Duration,
    warm_ready: usize,
) -> Action {
    if !active || since_last.is_some_and(|t| t < step) {
        Action::Wait
    } else if warm_ready > 0 {
        Action::EndWarm
    } else {
        Action::HibernateIdle
    }
}

/// What of `h` counts as pressure under `p` and `memory_headroom` (the
/// share of `MemTotal` kept available), as words for the journal; empty:
/// nothing. A host without PSI is judged by `MemAvailable` alone.
pub(crate) fn over_thresholds(
    h: &HostSample,
    p: &crate::config::PressureConfig,
    memory_headroom: f64,
) -> Vec<String> {
    let mut over = Vec::new();
    if let Some(c) = h.cpu_pressure_pct.filter(|c| *c >= p.cpu_pct) {
        over.push(format!("cpu pressure {c:.0} % >= {:.0} %", p.cpu_pct));
    }
    if let Some(m) = h.mem_pressure_pct.filter(|m| *m >= p.memory_pct) {
        over.push(format!("memory pressure {m:.0} % >= {:.0} %", p.memory_pct));
    }
    let floor = (h.mem_total_bytes as f64 * memory_headroom) as u64;
    if h.mem_total_bytes > 0 && h.mem_available_bytes < floor {
        over.push(format!(
            "{} MiB available < {} MiB kept free",
            h.mem_available_bytes >> 20,
            floor >> 20
        ));
    }
    over
}

/// The monitor's view, for `/v1/stats` and the warm-pool filler.
#[derive(Debug, Default)]
pub(crate) struct PressureState {
    /// Over a threshold for `sustain` readings now.
    active: AtomicBool,
    /// Hibernations made for pressure (monitor and admission).
    hibernated: AtomicU64,
    last: Mutex<Option<PressureReading>>,
}

impl PressureState {
    /// Whether the host is under pressure now.
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }
}

/// One reading of the monitor (`/v1/stats` `pressure`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PressureReading {
    /// The host over the last interval.
    pub host: HostSample,
    /// What counted as pressure in it (empty: nothing).
    pub over: Vec<String>,
    /// Readings in a row with pressure.
    pub streak: u32,
    /// Whether pressure hibernation acts now.
    pub active: bool,
    /// Hibernations made for pressure since the daemon started.
    pub hibernated: u64,
}

impl Service {
    /// The monitor's last reading (`None`: off, or no reading yet).
    pub fn pressure_reading(&self) -> Option<PressureReading> {
        self.pressure
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether the host is under pressure now (the warm-pool filler waits).
    pub(crate) fn under_pressure(&self) -> bool {
        self.pressure.active()
    }

    /// When sandbox `id` was last used, exactly when this daemon saw it,
    /// else as the store has it.
    fn last_used(&self, id: &SandboxId, stored: DateTime<Utc>) -> DateTime<Utc> {
        self.activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map_or(stored, |t| (*t).max(stored))
    }

    /// The sandboxes that are idle (module documentation) and not in
    /// `exclude`, the least recently used first; and whether a hibernation
    /// is under way (begun, not ended: its VM still holds its room).
    pub(crate) async fn idle_sandboxes(
        &self,
        exclude: &[SandboxId],
    ) -> ServiceResult<(Vec<(SandboxId, DateTime<Utc>)>, bool)> {
        let min_idle = chrono::TimeDelta::from_std(self.config.pressure.min_idle)
            .unwrap_or(chrono::TimeDelta::MAX);
        let now = self.now();
        let reserved = self.db(|s| s.reserved_sandboxes()).await?;
        let hibernating = reserved.iter().any(|r| r.pending_op == Some(Op::Hibernate));
        let candidates: Vec<Candidate> = reserved
            .into_iter()
            .map(|r| Candidate {
                last_used: self.last_used(&r.id, r.last_activity_at),
                pending: r.pending_op.is_some(),
                state: r.state,
                id: r.id,
            })
            .collect();
        let out = idle_order(candidates, exclude, now, min_idle, |id| {
            self.engine.open_calls(id)
        });
        Ok((out, hibernating))
    }

    /// Hibernates the least recently used idle sandbox not in `tried`
    /// (with its memory; `why` is recorded in its journal events). Every
    /// sandbox ruled out is added to `tried`; one whose lock a background
    /// operation (a rolling snapshot, another hibernation) holds is not, and
    /// is reported as [`Freed::Pending`] when nothing else could be
    /// hibernated, as is a hibernation already under way elsewhere: room is
    /// on its way, and admission waits for it rather than refuse.
    pub(crate) async fn hibernate_one_idle(&self, why: &str, tried: &mut Vec<SandboxId>) -> Freed {
        let Some(me) = self.me.upgrade() else {
            return Freed::Nothing;
        };
        let min_idle = chrono::TimeDelta::from_std(self.config.pressure.min_idle)
            .unwrap_or(chrono::TimeDelta::MAX);
        let (candidates, mut pending) = match self.idle_sandboxes(tried).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e.message(), "listing idle sandboxes failed");
                return Freed::Nothing;
            }
        };
        for (id, _) in candidates {
            if !self.may_auto_resume(&id).await.unwrap_or(false) {
                tried.push(id);
                continue;
            }
            let Ok(g) = self.acquire(&id, Op::Hibernate, Who::Background).await else {
                if self.held_by_background(&id) {
                    // A rolling snapshot (or another hibernation): it ends
                    // in well under a second; asked again then.
                    tracing::debug!(sandbox = %id, "idle candidate busy with a background operation");
                    pending = true;
                } else {
                    tried.push(id); // a user operation holds it: not idle
                }
                continue;
            };
            tried.push(id.clone());
            // Asked again under its lock: a call may have started meanwhile.
            let rec = match self.record(&id).await {
                Ok(r) => r,
                Err(_) => continue,
            };
            // Its own lock is held now: no other operation is pending.
            let idle = is_idle(
                rec.state,
                false,
                self.last_used(&id, rec.last_activity_at),
                self.now(),
                min_idle,
                || self.engine.open_calls(&id),
            );
            if !idle {
                continue;
            }
            let started = Instant::now();
            match me.hibernate_because(&id, g, true, Some(why)).await {
                Ok(_) => {
                    self.pressure.hibernated.fetch_add(1, Ordering::SeqCst);
                    self.metrics.count(PRESSURE_HIBERNATION);
                    info!(sandbox = %id, why, ms = started.elapsed().as_millis() as u64, "idle sandbox hibernated for pressure");
                    return Freed::Hibernated(id);
                }
                Err(e) => warn!(sandbox = %id, error = %e.message(), "pressure hibernation failed"),
            }
        }
        if pending {
            Freed::Pending
        } else {
            Freed::Nothing
        }
    }

    /// Runs the pressure monitor every `[pressure] interval` until `stop`
    /// turns true (`None`: `[pressure] enabled = false`).
    pub fn spawn_pressure(
        self: &Arc<Self>,
        mut stop: watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let cfg = self.config.pressure.clone();
        if !cfg.enabled {
            return None;
        }
        let this = self.clone();
        Some(tokio::spawn(async move {
            let mut reader = HostReader::new();
            let mut tick = tokio::time::interval(cfg.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut streak = 0u32;
            let mut last_action: Option<Instant> = None;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    r = stop.changed() => if r.is_err() { break },
                }
                if *stop.borrow() {
                    break;
                }
                let Some(h) = reader.sample(this.now()) else {
                    continue;
                };
                let over = over_thresholds(
                    &h,
                    &this.config.pressure,
                    this.config.capacity.memory_headroom,
                );
                streak = if over.is_empty() { 0 } else { streak + 1 };
                let active = streak >= cfg.sustain.max(1);
                this.pressure.active.store(active, Ordering::SeqCst);
                *this.pressure.last.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(PressureReading {
                        host: h,
                        over: over.clone(),
                        streak,
                        active,
                        hibernated: this.pressure.hibernated.load(Ordering::SeqCst),
                    });
                let warm_ready = this.warm_pool_stats().iter().map(|p| p.ready).sum();
                let action = next_action(
                    active,
                    last_action.map(|t| t.elapsed()),
                    cfg.step,
                    warm_ready,
                );
                if action == Action::Wait {
                    continue;
                }
                let why = format!("pressure: {}", over.join(", "));
                if action == Action::EndWarm {
                    let mut ended = 0;
                    while this.evict_one_warm() {
                        ended += 1;
                    }
                    if ended > 0 {
                        info!(ended, why, "warm guests ended for pressure");
                        last_action = Some(Instant::now());
                        continue;
                    }
                    // Claimed meanwhile: on to the sandboxes.
                }
                if let Freed::Hibernated(_) = this.hibernate_one_idle(&why, &mut Vec::new()).await {
                    last_action = Some(Instant::now());
                }
            }
            this.pressure.active.store(false, Ordering::SeqCst);
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PressureConfig;

    const MIN_IDLE: chrono::TimeDelta = chrono::TimeDelta::seconds(15);

    fn cand(id: &SandboxId, last_used: DateTime<Utc>) -> Candidate {
        Candidate {
            id: id.clone(),
            state: SandboxState::Running,
            pending: false,
            last_used,
        }
    }

    fn ids(n: usize) -> Vec<SandboxId> {
        let mut v: Vec<SandboxId> = (0..n).map(|_| SandboxId::generate()).collect();
        v.sort();
        v
    }

    #[test]
    fn the_least_recently_used_idle_sandbox_goes_first() {
        let now = Utc::now();
        let ago = |s: i64| now - chrono::TimeDelta::seconds(s);
        let s = ids(3);
        // Listed in any order: the oldest activity first.
        let got = idle_order(
            [
                cand(&s[0], ago(20)),
                cand(&s[1], ago(300)),
                cand(&s[2], ago(60)),
            ],
            &[],
            now,
            MIN_IDLE,
            |_| Some(0),
        );
        assert_eq!(
            got,
            vec![
                (s[1].clone(), ago(300)),
                (s[2].clone(), ago(60)),
                (s[0].clone(), ago(20))
            ]
        );
    }

    #[test]
    fn a_call_in_flight_or_an_engine_that_cannot_tell_is_never_idle() {
        let now = Utc::now();
        let ago = |s: i64| now - chrono::TimeDelta::seconds(s);
        let s = ids(3);
        let got = idle_order(
            [
                cand(&s[0], ago(600)),
                cand(&s[1], ago(500)),
                cand(&s[2], ago(400)),
            ],
            &[],
            now,
            MIN_IDLE,
            // The least recently used has an exec in flight; the engine
            // cannot tell for the second.
            |id| {
                if *id == s[0] {
                    Some(1)
                } else if *id == s[1] {
                    None
                } else {
                    Some(0)
                }
            },
        );
        assert_eq!(got, vec![(s[2].clone(), ago(400))]);
    }

    #[test]
    fn recent_use_pending_operations_other_states_and_exclusions_are_skipped() {
        let now = Utc::now();
        let ago = |s: i64| now - chrono::TimeDelta::seconds(s);
        let s = ids(7);
        let mut pending = cand(&s[1], ago(900));
        pending.pending = true;
        let mut hibernated = cand(&s[2], ago(900));
        hibernated.state = SandboxState::Hibernated;
        let mut paused = cand(&s[3], ago(100));
        paused.state = SandboxState::Paused;
        let asked = std::cell::RefCell::new(Vec::new());
        let got = idle_order(
            [
                cand(&s[0], ago(14)), // used 14 s ago: under min_idle
                pending,
                hibernated,
                paused,                // paused counts: its memory is still held
                cand(&s[4], ago(900)), // excluded (the one admitted)
                cand(&s[5], ago(15)),  // exactly min_idle: idle
                cand(&s[6], ago(200)),
            ],
            &[s[4].clone()],
            now,
            MIN_IDLE,
            |id| {
                asked.borrow_mut().push(id.clone());
                Some(0)
            },
        );
        assert_eq!(
            got,
            vec![
                (s[6].clone(), ago(200)),
                (s[3].clone(), ago(100)),
                (s[5].clone(), ago(15))
            ]
        );
        // The agent connection is asked only about those idle otherwise.
        let mut asked = asked.into_inner();
        asked.sort();
        assert_eq!(asked, vec![s[3].clone(), s[5].clone(), s[6].clone()]);
    }

    #[test]
    fn ties_in_last_use_go_by_id() {
        let now = Utc::now();
        let t = now - chrono::TimeDelta::seconds(60);
        let s = ids(3);
        let got = idle_order(
            [cand(&s[2], t), cand(&s[0], t), cand(&s[1], t)],
            &[],
            now,
            MIN_IDLE,
            |_| Some(0),
        );
        let order: Vec<SandboxId> = got.into_iter().map(|(id, _)| id).collect();
        assert_eq!(order, s);
    }

    #[test]
    fn warm_guests_end_before_any_sandbox_and_actions_are_spaced_by_step() {
        let step = Duration::from_secs(2);
        assert_eq!(next_action(false, None, step, 3), Action::Wait);
        assert_eq!(next_action(true, None, step, 3), Action::EndWarm);
        assert_eq!(next_action(true, None, step, 0), Action::HibernateIdle);
        assert_eq!(
            next_action(true, Some(Duration::from_secs(1)), step, 0),
            Action::Wait
        );
        assert_eq!(
            next_action(true, Some(step), step, 0),
            Action::HibernateIdle
        );
        assert_eq!(next_action(true, Some(step), step, 1), Action::EndWarm);
    }

    fn host(cpu: Option<f64>, mem: Option<f64>, total_mib: u64, avail_mib: u64) -> HostSample {
        HostSample {
            at: Utc::now(),
            cpus: 2,
            cpu_busy_cores: 1.0,
            mem_total_bytes: total_mib << 20,
            mem_available_bytes: avail_mib << 20,
            cpu_pressure_pct: cpu,
            mem_pressure_pct: mem,
            mem_full_pressure_pct: None,
        }
    }

    #[test]
    fn cpu_pressure_memory_pressure_and_mem_available_each_count() {
        let p = PressureConfig::default(); // cpu 60 %, memory 10 %
        let headroom = 0.10;
        // Quiet: nothing.
        assert!(
            over_thresholds(&host(Some(5.0), Some(0.0), 10_000, 5_000), &p, headroom).is_empty()
        );
        // CPU stall at the threshold counts.
        assert_eq!(
            over_thresholds(&host(Some(60.0), Some(0.0), 10_000, 5_000), &p, headroom),
            vec!["cpu pressure 60 % >= 60 %"]
        );
        // Memory stall.
        assert_eq!(
            over_thresholds(&host(Some(0.0), Some(25.0), 10_000, 5_000), &p, headroom),
            vec!["memory pressure 25 % >= 10 %"]
        );
        // MemAvailable under the headroom, on a host without PSI.
        assert_eq!(
            over_thresholds(&host(None, None, 10_000, 999), &p, headroom),
            vec!["999 MiB available < 1000 MiB kept free"]
        );
        assert!(over_thresholds(&host(None, None, 10_000, 1_000), &p, headroom).is_empty());
        // No MemTotal read: no memory verdict.
        assert!(over_thresholds(&host(None, None, 0, 0), &p, headroom).is_empty());
        // All at once, in that order.
        assert_eq!(
            over_thresholds(&host(Some(90.0), Some(50.0), 10_000, 10), &p, headroom).len(),
            3
        );
    }
}
