//! The QEMU `microvm` driver.
//!
//! Process model: QEMU is spawned in its own session (`setsid`), stdin from
//! `/dev/null`, stdout and stderr appended to `<run>/qemu.stderr`, its pid written to
//! `<run>/qemu.pid`. Nothing ties it to the starting process, so it keeps running
//! when that process dies (even by `kill -9`), and a later process adopts it.
//! Exit detection: a child is reaped (exit code or signal); an adopted VM is watched
//! through a pidfd. Either way the reason is completed from the QMP events seen
//! (`SHUTDOWN` with its reason, `GUEST_PANICKED`), the tail of `qemu.stderr` and of
//! the console.
//!
//! The rooms:
//! - `driver`: [`QemuDriver`], which starts (spawn, QMP handshake, restore) and adopts
//!   VMs, and the run dir they share ([`qemu_in_run_dir`]).
//! - `vm`: [`QemuVm`], the handle on one running VM (QMP commands, shutdown, kill).
//! - `migration`: device state written to and read from a file (`migrate fd:`/`exec:`,
//!   or directly: `xen-save-devices-state` completed by `stream`).
//! - `confine`: the VM's cgroup: made before the spawn, checked after it, recorded in
//!   `<run>/cgroup.json` for adopters.
//! - `exit`: the monitor task that waits for the process to end and says why.
//! - `port`: the watcher of the guest's agent port (`VSERPORT_CHANGE`).

mod confine;
mod driver;
mod exit;
mod migration;
mod port;
pub mod stream;
mod vm;

pub use driver::{qemu_in_run_dir, QemuDriver};
pub use migration::{
    completion_events, direct_save, set_completion_events, set_direct_save, set_save_in_memory,
    set_shared_round_trips,
};
pub use vm::QemuVm;

/// An error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}
