//! Resolving `auto` acceleration: does KVM really run our guest kernel?
//!
//! `/dev/kvm` opening is not enough: on a nested PVM host it opens, but a stock
//! Debian kernel hangs under it. The probe boots the guest kernel itself under
//! `-accel kvm` without an initramfs and root disk; a kernel that works reaches
//! the "VFS: Unable to mount root fs" panic (the end of kernel init) within a second
//! or so, and with `panic=-1 -no-reboot` QEMU exits. No marker within the timeout
//! means KVM is not usable for this kernel, and TCG is chosen.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::spec::ResolvedAccel;

/// Default time the KVM probe boot may take.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// Serial output lines that prove the kernel got to the end of its init.
const MARKERS: &[&str] = &["Kernel panic", "VFS: Unable to mount root", "Run /init"];

/// Outcome of a KVM probe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvmProbe {
    /// Whether KVM ran the kernel to the end of its init.
    pub usable: bool,
    /// Why (shown in logs when falling back to TCG).
    pub reason: String,
    /// How long the probe took.
    pub elapsed: Duration,
}

impl KvmProbe {
    /// The accelerator this outcome chooses.
    pub fn accel(&self) -> ResolvedAccel {
        if self.usable {
            ResolvedAccel::Kvm
        } else {
            ResolvedAccel::Tcg
        }
    }
}

type Key = (PathBuf, PathBuf, u64, Option<SystemTime>);

fn cache() -> &'static tokio::sync::Mutex<HashMap<Key, KvmProbe>> {
    static CACHE: OnceLock<tokio::sync::Mutex<HashMap<Key, KvmProbe>>> = OnceLock::new();
    CACHE.get_or_init(|| tokio::sync::Mutex::new(HashMap::new()))
}

/// Probes KVM once per process for this (QEMU binary, kernel file); later calls
/// return the cached outcome. Concurrent callers wait for the same probe.
pub async fn probe_kvm_cached(qemu: &Path, kernel: &Path, timeout: Duration) -> KvmProbe {
    let meta = std::fs::metadata(kernel).ok();
    let key = (
        qemu.to_path_buf(),
        kernel.to_path_buf(),
        meta.as_ref().map_or(0, |m| m.len()),
        meta.and_then(|m| m.modified().ok()),
    );
    let mut map = cache().lock().await;
    if let Some(hit) = map.get(&key) {
        return hit.clone();
    }
    let outcome = probe_kvm(qemu, kernel, timeout).await;
    if outcome.usable {
        tracing::info!(
            elapsed_ms = outcome.elapsed.as_millis() as u64,
            "KVM probe: using kvm"
        );
    } else {
        tracing::warn!(reason = %outcome.reason, elapsed_ms = outcome.elapsed.as_millis() as u64,
            "KVM probe failed, falling back to tcg");
    }
    map.insert(key, outcome.clone());
    outcome
}

/// Runs the probe (uncached).
pub async fn probe_kvm(qemu: &Path, kernel: &Path, timeout: Duration) -> KvmProbe {
    let t0 = Instant::now();
    let done = |usable: bool, reason: String| KvmProbe {
        usable,
        reason,
        elapsed: t0.elapsed(),
    };
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return done(false, format!("/dev/kvm cannot be opened: {e}"));
    }
    if !kernel.exists() {
        return done(false, format!("probe kernel {kernel:?} does not exist"));
    }
    let mut cmd = tokio::process::Command::new(qemu);
    cmd.args([
        "-M",
        "microvm,x-option-roms=off,rtc=on",
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-m",
        "128",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-append",
        "console=ttyS0 panic=-1 loglevel=1",
        "-kernel",
    ])
    .arg(kernel)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return done(false, format!("cannot run {qemu:?}: {e}")),
    };
    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        return done(false, "probe QEMU has no stdio pipes".into());
    };
    let mut seen = Vec::new();
    let mut stderr = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            let n = out.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                return false;
            }
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen);
            if MARKERS.iter().any(|m| text.contains(m)) {
                return true;
            }
        }
    };
    let reached = tokio::time::timeout(timeout, read).await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = tokio::time::timeout(Duration::from_millis(200), err.read_to_end(&mut stderr)).await;
    match reached {
        Ok(true) => done(true, "guest kernel completed init under kvm".into()),
        Ok(false) => done(
            false,
            format!(
                "QEMU under kvm exited before the kernel finished init: {}",
                crate::process::last_lines(&String::from_utf8_lossy(&stderr), 2)
            ),
        ),
        Err(_) => done(
            false,
            format!(
                "guest kernel did not finish init under kvm within {:.1} s ({} bytes of console output; a nested/PVM host?)",
                timeout.as_secs_f64(),
                seen.len()
            ),
        ),
    }
}
