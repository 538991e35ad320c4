//! The pause phases of the snapshots the in-process daemon takes, read from
//! its `snapshot taken` log events (`strata_runtime::runtime::snapshot`),
//! for sections that only see snapshots through the API (which records a
//! snapshot's `pause_ms`, not its phases).
//!
//! Contract: nothing is kept until a section calls [`start`]; [`take`]
//! drains what was kept (at most [`MAX_KEPT`] entries: older ones are
//! dropped first).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// The target of the runtime's `snapshot taken` events.
pub const TARGET: &str = "strata_runtime::runtime::snapshot";

/// Entries kept between two [`take`]s at most.
pub const MAX_KEPT: usize = 100_000;

/// One snapshot's pause phases, ms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    /// The whole pause.
    pub pause_ms: f64,
    /// QMP `stop`.
    pub stop_ms: f64,
    /// The device-state save.
    pub device_state_ms: f64,
    /// The btrfs snapshot.
    pub btrfs_ms: f64,
    /// QMP `cont`.
    pub cont_ms: f64,
    /// Before the pause, the guest running: RAM written back and the
    /// pool's transaction committed (not part of `pause_ms`).
    pub before_pause_ms: f64,
    /// After `cont`, paused by copies: the btrfs snapshot and its commit
    /// (not part of `pause_ms`).
    pub after_pause_ms: f64,
    /// Whether the guest was paused by copies (`copies_in_pause`).
    pub copies_in_pause: bool,
    /// Whether the pause ran boosted (`boosted`: `Runtime::set_pause_boost`).
    pub boosted: bool,
    /// Paused by copies: the RAM copy's catch-up, in the pause.
    pub copy_mem_ms: f64,
    /// Paused by copies: the disk image's reflink, in the pause.
    pub copy_disk_ms: f64,
}

static ON: AtomicBool = AtomicBool::new(false);
static KEPT: Mutex<VecDeque<Phases>> = Mutex::new(VecDeque::new());

/// Starts keeping the phases of every snapshot taken from now on.
pub fn start() {
    ON.store(true, Ordering::SeqCst);
}

/// Stops keeping them (and drops what was kept).
pub fn stop() {
    ON.store(false, Ordering::SeqCst);
    KEPT.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// The phases kept since the last call, oldest first.
pub fn take() -> Vec<Phases> {
    KEPT.lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain(..)
        .collect()
}

/// The layer that keeps them; install it with a filter that lets
/// [`TARGET`]'s INFO events through.
pub struct Capture;

#[derive(Default)]
struct Fields {
    taken: bool,
    p: Phases,
}

impl Visit for Fields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        match field.name() {
            "pause_ms" => self.p.pause_ms = value,
            "stop_ms" => self.p.stop_ms = value,
            "device_state_ms" => self.p.device_state_ms = value,
            "btrfs_ms" => self.p.btrfs_ms = value,
            "cont_ms" => self.p.cont_ms = value,
            "before_pause_ms" => self.p.before_pause_ms = value,
            "after_pause_ms" => self.p.after_pause_ms = value,
            "copy_mem_ms" => self.p.copy_mem_ms = value,
            "copy_disk_ms" => self.p.copy_disk_ms = value,
            _ => {}
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        match field.name() {
            "copies_in_pause" => self.p.copies_in_pause = value,
            "boosted" => self.p.boosted = value,
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" && value == "snapshot taken" {
            self.taken = true;
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && format!("{value:?}") == "snapshot taken" {
            self.taken = true;
        }
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if !ON.load(Ordering::Relaxed) || event.metadata().target() != TARGET {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        if !f.taken {
            return;
        }
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= MAX_KEPT {
            kept.pop_front();
        }
        kept.push_back(f.p);
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::prelude::*;

    use super::*;

    #[test]
    fn keeps_the_phases_of_snapshot_taken_events_only_while_on() {
        let sub = tracing_subscriber::registry().with(Capture);
        tracing::subscriber::with_default(sub, || {
            tracing::info!(target: TARGET, pause_ms = 9.0, btrfs_ms = 3.0, "snapshot taken");
            start();
            tracing::info!(target: TARGET, pause_ms = 9.5, stop_ms = 0.5, device_state_ms = 7.0, btrfs_ms = 3.1, cont_ms = 0.6, before_pause_ms = 40.0, after_pause_ms = 55.0, copies_in_pause = true, boosted = true, "snapshot taken");
            tracing::info!(target: TARGET, pause_ms = 1.0, "something else");
            tracing::info!(target: "elsewhere", pause_ms = 2.0, "snapshot taken");
        });
        let got = take();
        stop();
        assert_eq!(
            got,
            vec![Phases {
                pause_ms: 9.5,
                stop_ms: 0.5,
                device_state_ms: 7.0,
                btrfs_ms: 3.1,
                cont_ms: 0.6,
                before_pause_ms: 40.0,
                after_pause_ms: 55.0,
                copies_in_pause: true,
                boosted: true,
                ..Default::default()
            }]
        );
    }
}
