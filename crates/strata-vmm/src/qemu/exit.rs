//! How the end of a VM's process is seen and explained.
//!
//! Contract: every VM handle has one `monitor` task. It waits for the process to end
//! (a child is reaped, giving its exit code or signal; an adopted VM is watched through
//! its pidfd, giving neither), lets the QMP reader drain the last events, removes the
//! VM's cgroup, and then sends exactly one `Some(VmExit)` on the handle's watch channel.
//! Readers ([`wait`]) see that value, however late they come; the channel closing
//! without one means the handle was dropped. The reason is one line, written by
//! [`exit_reason`] from the QMP events (`SHUTDOWN` with its reason, `GUEST_PANICKED`),
//! the exit status and the tails of `qemu.stderr` and of the console.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::error_chain;
use crate::cgroup::VmCgroup;
use crate::process::{last_lines, pid_exists, tail_file};
use crate::qmp::QmpClient;
use crate::spec::VmSpec;
use crate::VmExit;

/// How the monitor learns that the process ended.
pub(super) enum Exiter {
    /// Our child: reaped, with its exit status.
    Child(tokio::process::Child),
    /// Started by another process: watched through the pidfd, no exit status.
    Adopted,
}

/// The exit published on `rx`, once there is one.
pub(super) async fn wait(mut rx: watch::Receiver<Option<VmExit>>) -> VmExit {
    loop {
        if let Some(e) = rx.borrow_and_update().clone() {
            return e;
        }
        if rx.changed().await.is_err() {
            // The monitor task is gone without a result: only when this handle was dropped.
            return VmExit {
                reason: "exit watcher stopped".into(),
                code: None,
                signal: None,
                expected: false,
                events: vec![],
                stderr_tail: String::new(),
                console_tail: String::new(),
            };
        }
    }
}

/// Waits for the process to end, then publishes a [`VmExit`].
pub(super) async fn monitor(
    spec: VmSpec,
    pidfd: Arc<OwnedFd>,
    qmp: Arc<QmpClient>,
    expected: Arc<AtomicBool>,
    exiter: Exiter,
    tx: watch::Sender<Option<VmExit>>,
    cgroup: Option<VmCgroup>,
) {
    let (code, signal) = match exiter {
        Exiter::Child(mut child) => match child.wait().await {
            Ok(st) => {
                use std::os::unix::process::ExitStatusExt;
                (st.code(), st.signal())
            }
            Err(_) => (None, None),
        },
        Exiter::Adopted => {
            wait_pidfd(&pidfd, spec.pid_file().as_path()).await;
            (None, None)
        }
    };
    // QEMU sends SHUTDOWN before it exits; let the QMP reader drain it.
    let t0 = Instant::now();
    while !qmp.is_closed() && t0.elapsed() < Duration::from_millis(500) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The process is gone: its cgroup goes before anyone hears of the exit.
    if let Some(cg) = cgroup {
        if let Err(e) = cg.remove().await {
            tracing::warn!(name = %spec.name, error = %error_chain(&e), "cannot remove the VM's cgroup");
        }
    }
    let events = qmp.events();
    let stderr_tail = last_lines(&tail_file(&spec.stderr_file(), 4096), 5);
    let console_text = tail_file(&spec.console_log(), 32 * 1024);
    let mut console_tail = last_lines(&console_text, 5);
    // A panic's backtrace pushes its headline out of the last lines: keep the headline.
    if let Some(line) = console_text
        .lines()
        .rev()
        .find(|l| l.contains("Kernel panic"))
    {
        if !console_tail.contains("Kernel panic") {
            console_tail = format!("{} | ... | {console_tail}", line.trim());
        }
    }
    let expected = expected.load(Ordering::SeqCst);
    let reason = exit_reason(&events, code, signal, expected, &stderr_tail, &console_tail);
    if expected {
        tracing::info!(name = %spec.name, %reason, "VM exited");
    } else {
        tracing::warn!(name = %spec.name, %reason, "VM exited unexpectedly");
    }
    let _ = tx.send(Some(VmExit {
        reason,
        code,
        signal,
        expected,
        events: events
            .iter()
            .rev()
            .take(16)
            .rev()
            .map(|e| e.event.clone())
            .collect(),
        stderr_tail,
        console_tail,
    }));
}

async fn wait_pidfd(pidfd: &OwnedFd, pid_file: &Path) {
    let registered = pidfd.try_clone().ok().and_then(|fd| {
        // SAFETY: `fd` is an owned, open pidfd that moves into the AsyncFd and stays
        // open, referring to the same process, until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.ok()
    });
    match registered {
        Some(afd) => {
            let _ = afd.readable().await;
        }
        _ => {
            // No epoll for this fd: poll the pid file's process instead.
            let pid: Option<u32> = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            while pid.is_some_and(pid_exists) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = pidfd.as_raw_fd();
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGSYS => "SIGSYS (seccomp)",
        _ => "signal",
    }
}

fn exit_reason(
    events: &[crate::QmpEvent],
    code: Option<i32>,
    signal: Option<i32>,
    expected: bool,
    stderr_tail: &str,
    console_tail: &str,
) -> String {
    let mut parts = Vec::new();
    let panicked =
        events.iter().any(|e| e.event == "GUEST_PANICKED") || console_tail.contains("Kernel panic");
    if let Some(sd) = events.iter().rev().find(|e| e.event == "SHUTDOWN") {
        let r = sd
            .data
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or("unknown");
        parts.push(match r {
            "guest-shutdown" => "guest powered off".to_owned(),
            "guest-reset" if panicked => "guest kernel panicked (and reset)".to_owned(),
            "guest-reset" => "guest rebooted (QEMU runs with -no-reboot)".to_owned(),
            "guest-panic" => "guest kernel panicked".to_owned(),
            "host-qmp-quit" => "QEMU quit on host request".to_owned(),
            "host-signal" => "QEMU got a termination signal".to_owned(),
            other => format!("QEMU shut down ({other})"),
        });
    } else if panicked {
        parts.push("guest kernel panicked".to_owned());
    }
    match (code, signal) {
        (_, Some(sig)) => parts.push(format!("QEMU killed by {} ({sig})", signal_name(sig))),
        (Some(0), None) if parts.is_empty() => parts.push("QEMU exited with code 0".into()),
        (Some(0), None) => {}
        (Some(c), None) => parts.push(format!("QEMU exited with code {c}")),
        (None, None) if parts.is_empty() => parts.push(
            "QEMU process disappeared (adopted process: no exit status, no SHUTDOWN event seen)"
                .into(),
        ),
        (None, None) => {}
    }
    if expected {
        parts.push("as requested".into());
    } else if !stderr_tail.is_empty() {
        parts.push(format!("stderr: {stderr_tail}"));
    }
    if panicked && !console_tail.is_empty() {
        parts.push(format!("console: {console_tail}"));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::QmpEvent;

    fn ev(name: &str, data: Value) -> QmpEvent {
        QmpEvent {
            event: name.into(),
            data,
        }
    }

    #[test]
    fn exit_reasons_read_well() {
        assert_eq!(
            exit_reason(&[], None, Some(9), false, "", ""),
            "QEMU killed by SIGKILL (9)"
        );
        let r = exit_reason(
            &[ev(
                "SHUTDOWN",
                json!({"guest": true, "reason": "guest-reset"}),
            )],
            Some(0),
            None,
            false,
            "",
            "[ 1.0] Kernel panic - not syncing: Attempted to kill init!",
        );
        assert!(
            r.starts_with("guest kernel panicked (and reset); console: "),
            "{r}"
        );
        let r = exit_reason(&[], None, None, false, "qemu: error xyz", "");
        assert!(
            r.contains("no exit status") && r.contains("stderr: qemu: error xyz"),
            "{r}"
        );
        let r = exit_reason(
            &[ev("SHUTDOWN", json!({"reason": "host-qmp-quit"}))],
            Some(0),
            None,
            true,
            "",
            "",
        );
        assert_eq!(r, "QEMU quit on host request; as requested");
    }
}
