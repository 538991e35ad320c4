//! Shared fixtures for strata's integration tests: the workspace, the release
//! guest agent, the guest image built from it, and short scratch directories.
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
//! - `CARGO_TARGET_DIR`: honoured when locating the release agent.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

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

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target"),
    }
}

/// Newest modification time of the files under `dir` (recursively).
fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().ok()?.modified().ok()
        };
        newest = newest.max(t);
    }
    newest
}

/// Path to the release guest agent, `target/release/strata-agent`. Runs
/// `cargo build --release -p strata-agent` first if it is missing or older
/// than the sources (`src/`, `Cargo.toml`) of the agent and its protocol crate.
///
/// Panics with cargo's exit status if the build fails: this is test support.
pub fn agent_binary() -> PathBuf {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT
        .get_or_init(|| {
            let root = workspace_root();
            let bin = target_dir().join("release").join("strata-agent");
            let built = bin.metadata().and_then(|m| m.modified()).ok();
            // Sources of the agent and its protocol crate. Not Cargo.lock: it
            // changes whenever anyone adds a dependency anywhere.
            let sources = ["crates/strata-agent", "crates/strata-proto"]
                .iter()
                .flat_map(|c| ["src", "Cargo.toml"].map(|f| root.join(c).join(f)))
                .filter_map(|p| if p.is_dir() { newest_mtime(&p) } else { p.metadata().and_then(|m| m.modified()).ok() })
                .max();
            let stale = match (built, sources) {
                (None, _) => true,
                (Some(b), Some(s)) => s > b,
                (Some(_), None) => false,
            };
            if stale {
                eprintln!("strata-testkit: building the guest agent (cargo build --release -p strata-agent)");
                let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
                let status = Command::new(cargo)
                    .args(["build", "--release", "-p", "strata-agent"])
                    .current_dir(&root)
                    .status()
                    .unwrap_or_else(|e| panic!("strata-testkit: cannot run cargo: {e}"));
                assert!(status.success(), "strata-testkit: cargo build --release -p strata-agent failed: {status}");
            }
            assert!(bin.is_file(), "strata-testkit: {} missing after the build", bin.display());
            bin
        })
        .clone()
}

/// The guest image for tests, built once per process: the default recipe
/// with [`agent_binary`], in `$STRATA_IMAGE_CACHE` or
/// `/var/cache/strata/images` (a cache hit takes about a second). Progress goes
/// to stderr. With `STRATA_TEST_IMAGE=<dir>` that prebuilt image is loaded
/// instead.
///
/// Panics with the whole error chain if the image cannot be built or loaded.
pub fn test_image() -> &'static BuiltImage {
    static IMAGE: OnceLock<BuiltImage> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let result = match std::env::var_os("STRATA_TEST_IMAGE") {
            Some(dir) => strata_image::load(Path::new(&dir)),
            None => {
                let recipe = strata_image::ImageRecipe::new(agent_binary());
                let cache = strata_image::default_cache_dir();
                strata_image::build(&recipe, &cache, &|p| eprintln!("strata-image {p}"))
            }
        };
        match result {
            Ok(img) => img,
            Err(e) => panic!(
                "strata-testkit: guest image unavailable: {}",
                error_chain(&e)
            ),
        }
    })
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
