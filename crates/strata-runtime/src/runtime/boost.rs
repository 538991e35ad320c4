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
//! - A snapshot's pause is such a call too ([`Runtime::set_pause_boost`], on
//!   by default): from just before the guest stops until `cont` has been
//!   answered the VM has the call weight (its device-state save is QEMU's
//!   CPU), and the daemon thread catching up the snapshot's RAM and disk
//!   runs at nice [`PAUSE_NICE`] ([`ThreadNice`]). The guest is stopped for
//!   the user's call meanwhile; on a contended host its pause otherwise
//!   waits behind every other guest's timers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_core::SandboxId;
use strata_vmm::cgroup::DEFAULT_CPU_WEIGHT;

use super::vms::Live;
use super::Runtime;

/// The CPU weight of a sandbox with a call in flight, by default.
pub const CALL_CPU_WEIGHT: u32 = 1000;

/// The nice value of the daemon thread doing a pause's catch-up.
pub const PAUSE_NICE: i32 = -10;

/// The calling thread's nice value raised until dropped, then put back.
/// Best effort: where the daemon may not raise it (no `CAP_SYS_NICE`),
/// nothing changes.
#[derive(Debug)]
pub(super) struct ThreadNice {
    tid: libc::id_t,
    was: Option<i32>,
    /// Not `Send`: it restores the thread that made it.
    _here: std::marker::PhantomData<*const ()>,
}

impl ThreadNice {
    /// Sets the calling thread's nice value to `nice` (Linux keeps it per
    /// thread: `setpriority(PRIO_PROCESS, tid)` touches no other thread).
    pub(super) fn raise(nice: i32) -> Self {
        // SAFETY: `gettid` takes nothing and cannot fail.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        // SAFETY: `__errno_location` returns this thread's errno slot; the
        // write clears it so a -1 from `getpriority` can be told from an
        // error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `getpriority` reads a thread's nice value; no memory is
        // passed.
        let cur = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
        let failed = cur == -1 && std::io::Error::last_os_error().raw_os_error().unwrap_or(0) != 0;
        let mut was = None;
        if !failed && cur > nice {
            // SAFETY: `setpriority` changes only this thread's nice value;
            // no memory is passed.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } == 0 {
                was = Some(cur);
            }
        }
        ThreadNice {
            tid,
            was,
            _here: std::marker::PhantomData,
        }
    }
}

impl Drop for ThreadNice {
    fn drop(&mut self) {
        if let Some(was) = self.was {
            // SAFETY: as in `raise`; `tid` is this thread (a guard is not
            // `Send`: it is dropped on the thread that made it).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, self.tid, was) };
        }
    }
}

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

    /// Whether a snapshot's pause runs boosted (on by default; see the
    /// module documentation). Off for A/B runs (`strata-bench --only soak
    /// --soak-ab-kind boost`).
    pub fn set_pause_boost(&self, on: bool) {
        self.pause_boost.store(on, Ordering::Relaxed);
    }

    /// See [`Runtime::set_pause_boost`].
    pub fn pause_boost(&self) -> bool {
        self.pause_boost.load(Ordering::Relaxed)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn nice_now() -> i32 {
        // SAFETY: as in `ThreadNice::raise`.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        // SAFETY: reads this thread's nice value; no memory is passed.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
    }

    #[test]
    fn a_raised_thread_runs_at_the_pause_nice_and_gets_its_own_back() {
        let before = nice_now();
        // SAFETY: `geteuid` takes nothing and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        // A thread that exists already: it reads its own value once this
        // one is raised.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let _ = wait.recv();
            nice_now()
        });
        {
            let _n = ThreadNice::raise(PAUSE_NICE);
            if root {
                assert_eq!(nice_now(), PAUSE_NICE, "raised (as root)");
            }
            let _ = go.send(());
            assert_eq!(other.join().ok(), Some(before), "only this thread");
        }
        assert_eq!(nice_now(), before, "put back");
    }
}
