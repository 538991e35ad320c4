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
        let mut out = Vec::new();
        for r in reserved {
            if !matches!(r.state, SandboxState::Running | SandboxState::Paused)
                || r.pending_op.is_some()
                || exclude.contains(&r.id)
            {
                continue;
            }
            let last = self.last_used(&r.id, r.last_activity_at);
            if now - last < min_idle || self.engine.open_calls(&r.id) != Some(0) {
                continue;
            }
            out.push((r.id, last));
        }
        out.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
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
            let idle = matches!(rec.state, SandboxState::Running | SandboxState::Paused)
                && self.now() - self.last_used(&id, rec.last_activity_at) >= min_idle
                && self.engine.open_calls(&id) == Some(0);
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

    /// What of `h` counts as pressure under `[pressure]` (and `[capacity]
    /// memory_headroom`), as words for the journal.
    fn over_thresholds(&self, h: &HostSample) -> Vec<String> {
        let p = &self.config.pressure;
        let mut over = Vec::new();
        if let Some(c) = h.cpu_pressure_pct.filter(|c| *c >= p.cpu_pct) {
            over.push(format!("cpu pressure {c:.0} % >= {:.0} %", p.cpu_pct));
        }
        if let Some(m) = h.mem_pressure_pct.filter(|m| *m >= p.memory_pct) {
            over.push(format!("memory pressure {m:.0} % >= {:.0} %", p.memory_pct));
        }
        let floor = (h.mem_total_bytes as f64 * self.config.capacity.memory_headroom) as u64;
        if h.mem_total_bytes > 0 && h.mem_available_bytes < floor {
            over.push(format!(
                "{} MiB available < {} MiB kept free",
                h.mem_available_bytes >> 20,
                floor >> 20
            ));
        }
        over
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
                let over = this.over_thresholds(&h);
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
                if !active || last_action.is_some_and(|t| t.elapsed() < cfg.step) {
                    continue;
                }
                let why = format!("pressure: {}", over.join(", "));
                // Warm guests first, all of them.
                let mut ended = 0;
                while this.evict_one_warm() {
                    ended += 1;
                }
                if ended > 0 {
                    info!(ended, why, "warm guests ended for pressure");
                    last_action = Some(Instant::now());
                    continue;
                }
                if let Freed::Hibernated(_) = this.hibernate_one_idle(&why, &mut Vec::new()).await {
                    last_action = Some(Instant::now());
                }
            }
            this.pressure.active.store(false, Ordering::SeqCst);
        }))
    }
}
