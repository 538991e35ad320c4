//! Test and bench support of the strata workspace, in one place: the
//! workspace, the release guest agent and the guest image built from it,
//! the workspace's binaries and the CLI run against a daemon, one tokio
//! runtime per process, short scratch directories, a client of the `/v1`
//! API, the teardown of what a daemon leaves behind (QEMUs, a loop-mounted
//! pool), and — behind the feature `stratad` — fixtures of stratad's store.
//!
//! ```no_run
//! let image = strata_testkit::test_image();
//! let dir = strata_testkit::scratch_dir("vmm");
//! println!("{} {}", image.kernel.display(), dir.path().display());
//! ```
//!
//! Environment:
//! - `STRATA_TEST_IMAGE=<dir>`: use this prebuilt image directory (no build).
//! - `STRATA_IMAGE_CACHE=<dir>`: image cache (default `/var/cache/strata/images`).
//! - `CARGO_TARGET_DIR`: honoured when locating the release agent and the
//!   workspace's binaries.
//!
//! Who may use what: everything but `fixtures` names no type of stratad
//! and serves stratad's unit tests too. `fixtures` (feature `stratad`)
//! builds stratad's records: integration tests, examples and the benchmark
//! only, since a unit test of stratad would see two copies of the crate.

mod bin;
pub mod chaos;
mod cli;
#[cfg(feature = "stratad")]
pub mod fixtures;
pub mod http;
mod image;
pub mod registry;
pub mod teardown;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use bin::{strata_bin, stratad_bin, workspace_bin};
pub use cli::run_strata;
pub use http::{serve, Api, ApiError, Exec, Served};
pub use image::{agent_binary, test_image};
pub use strata_image::BuiltImage;

/// The root of the Cargo workspace (the directory of the top `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    // crates/strata-testkit → ../..
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| here.to_path_buf())
}

/// The Cargo target directory (`$CARGO_TARGET_DIR`, else `<workspace>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target"),
    }
}

/// The host's TSC frequency in kHz, from `/proc/cpuinfo` (`cpu MHz`), when
/// the CPU has a constant TSC. Under TCG the guest reads the host's TSC, so
/// passing `tsc_early_khz=<this>` on the guest kernel command line spares the
/// kernel its PIT calibration, which fails on a busy host (the boot then hangs
/// right after "tsc: Marking TSC unstable").
pub fn host_tsc_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags = info.lines().find(|l| l.starts_with("flags"))?;
    if !flags.split_whitespace().any(|f| f == "constant_tsc") {
        return None;
    }
    let mhz: f64 = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    (mhz > 0.0).then(|| (mhz * 1000.0).round() as u64)
}

/// `error: source: source …` on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

/// A fresh directory `/tmp/<prefix>-XXXXXX`, removed on drop. Kept short on
/// purpose: unix socket paths inside it must stay under 108 bytes.
///
/// Panics if `/tmp` is not writable.
pub fn scratch_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir_in("/tmp")
        .unwrap_or_else(|e| panic!("strata-testkit: cannot create a scratch dir in /tmp: {e}"))
}

/// The tokio runtime of this process (multi-threaded, two workers, every
/// driver on), built on first use. One per process on purpose: every VM's QMP
/// and agent tasks, and every pooled HTTP connection, live on the runtime that
/// made them, so a test binary that shares a daemon or a runtime across tests
/// must run them all on one.
///
/// Panics if the runtime cannot be built.
pub fn tokio_rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("strata-testkit: cannot build the tokio runtime: {e}"))
    })
}

/// A loopback TCP port free right now (for a daemon started on it next).
///
/// Panics if no port can be bound.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("strata-testkit: no free loopback port: {e}"))
}

/// `--name N` from this process's command line, else `default` (for
/// examples and benchmarks with a few numeric flags).
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// Btrfs pool fixture: the storage engineer adds it here (a loop-mounted
// btrfs pool per test binary, cleaned up on drop). No code yet.

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_root_has_the_workspace_manifest() {
        let root = workspace_root();
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
        assert!(root.join("crates/strata-agent").is_dir());
    }

    #[test]
    fn scratch_dirs_are_short_and_removed() {
        let d = scratch_dir("testkit");
        let p = d.path().to_path_buf();
        assert!(p.starts_with("/tmp"));
        // Room for a socket name under the 108-byte sun_path limit.
        assert!(
            p.join("agent.sock").as_os_str().len() < 40,
            "{}",
            p.display()
        );
        drop(d);
        assert!(!p.exists());
    }

    #[test]
    fn error_chain_joins_sources() {
        let inner = std::io::Error::other("disk full");
        let e = strata_image::ImageError::Io {
            what: "cannot write",
            path: "/x".into(),
            source: inner,
        };
        assert_eq!(error_chain(&e), "cannot write /x: disk full");
    }
}
