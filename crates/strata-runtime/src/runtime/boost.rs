//! CPU weight of a sandbox with a call in flight.
//!
//! Contract:
//! - While an exec, a file call or a directory listing is in flight on a
//!   live VM ([`Runtime::call_boost`], held by the caller for the call's
//!   whole life, an exec's output stream included), its cgroup has CPU
//!   weight [`Runtime::call_cpu_weight`] (default [`CALL_CPU_WEIGHT`], ten
//!   times everyone's [`DEFAULT_CPU_WEIGHT`]; under cgroup v1
//!   `cpu.shares` 10240 against 1024). When its last call ends the weight
//!   goes back to the default. So on a host whose CPUs are contended the
//!   guest someone is waiting on runs before idle guests' timers, the
//!   vCPUs of a guest being hibernated (its migration thread) and a new
//!   guest's boot; the `cpu.max` ceiling of each VM stays as it is.
//! - Calls are counted per live VM: the weight is written on the first and
//!   on the end of the last, not per call. A VM replaced meanwhile (a
//!   restore, a wake) has a new cgroup at the default weight; the guard of
//!   the old one writes nothing that matters (its cgroup is gone).
//! - A weight at or under the default turns the boost off
//!   ([`Runtime::set_call_cpu_weight`]); a VM without a cgroup is left alone.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_core::SandboxId;
use strata_vmm::cgroup::DEFAULT_CPU_WEIGHT;

use super::vms::Live;
use super::Runtime;

/// The CPU weight of a sandbox with a call in flight, by default.
pub const CALL_CPU_WEIGHT: u32 = 1000;

/// Calls in flight on one live VM and the weight written for them.
#[derive(Debug, Default)]
pub(super) struct CallCount {
    calls: u32,
    /// The weight written for them, while one is.
    boosted: bool,
}

/// One call in flight on a live VM; its VM's weight goes back to the
/// default when the last one is dropped.
pub struct CallBoost {
    live: Arc<Live>,
    id: SandboxId,
}

impl std::fmt::Debug for CallBoost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallBoost").field("id", &self.id).finish()
    }
}

fn set_weight(live: &Live, id: &SandboxId, weight: u32) -> bool {
    match live.vm.set_cpu_weight(weight) {
        Ok(set) => set,
        Err(e) => {
            tracing::debug!(sandbox = %id, weight, error = %e, "cannot set a VM's CPU weight");
            false
        }
    }
}

impl Drop for CallBoost {
    fn drop(&mut self) {
        let mut c = self.live.calls.lock().unwrap_or_else(|p| p.into_inner());
        c.calls = c.calls.saturating_sub(1);
        if c.calls == 0 && c.boosted {
            set_weight(&self.live, &self.id, DEFAULT_CPU_WEIGHT);
            c.boosted = false;
        }
    }
}

impl Runtime {
    /// Sets the CPU weight of a sandbox with a call in flight (from the
    /// next first call of a VM on); at or under [`DEFAULT_CPU_WEIGHT`]:
    /// no boost. For A/B runs (`strata-bench --only packing`).
    pub fn set_call_cpu_weight(&self, weight: u32) {
        self.call_weight.store(weight, Ordering::Relaxed);
    }

    /// The CPU weight of a sandbox with a call in flight (see the module
    /// documentation).
    pub fn call_cpu_weight(&self) -> u32 {
        self.call_weight.load(Ordering::Relaxed)
    }

    /// Counts a call in flight on sandbox `id`'s live VM until the guard is
    /// dropped; its first raises the VM's CPU weight. `None`: no live VM.
    pub fn call_boost(&self, id: &SandboxId) -> Option<CallBoost> {
        let live = self.live(id).ok()?;
        {
            let mut c = live.calls.lock().unwrap_or_else(|p| p.into_inner());
            c.calls += 1;
            let w = self.call_cpu_weight();
            if c.calls == 1 && !c.boosted && w > DEFAULT_CPU_WEIGHT {
                c.boosted = set_weight(&live, id, w);
            }
        }
        Some(CallBoost {
            live,
            id: id.clone(),
        })
    }
}
