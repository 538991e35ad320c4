//! The workspace's own binaries, for tests that run them as processes.
//!
//! A test of one package that runs another package's binary cannot use
//! `env!("CARGO_BIN_EXE_<name>")` (Cargo sets it only for the package's own
//! binaries): it asks here. The binary is looked up in the target directory
//! and built with Cargo when no profile has it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

use crate::target_dir;

/// Crates the daemon binary is built from (their `src/` and `Cargo.toml`).
const DAEMON_CRATES: &[&str] = &[
    "strata-daemon",
    "stratad",
    "strata-e2b",
    "strata-runtime",
    "strata-vmm",
    "strata-storage",
    "strata-image",
    "strata-proto",
    "strata-policy",
    "strata-core",
];

/// The daemon, `stratad` (crate `strata-daemon`), built on demand (see
/// [`workspace_bin`]) and rebuilt, once per process, when it is older than
/// the sources of the crates it links: no test package builds it for its
/// tests (as Cargo did for `CARGO_BIN_EXE_stratad` when the binary was
/// stratad's), and a stale daemon would test old code.
pub fn stratad_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = workspace_bin("stratad", "strata-daemon");
        if !older_than_sources(&bin, DAEMON_CRATES) {
            return bin;
        }
        cargo_build("stratad", "strata-daemon");
        workspace_bin("stratad", "strata-daemon")
    })
    .clone()
}

/// The CLI, `strata`, built on demand (see [`workspace_bin`]).
pub fn strata_bin() -> PathBuf {
    workspace_bin("strata", "strata-cli")
}

/// The binary `name` of the workspace package `package`: the first of
/// `<profile of this process>/<name>` (the directory the running test binary
/// was built in), `<target>/debug/<name>` and `<target>/release/<name>` that
/// exists; when none does, `cargo build -p <package>` (with `--release` when
/// this process runs from a release directory) and the same search again.
///
/// Panics when the build fails or the binary is still missing: this is test
/// support.
pub fn workspace_bin(name: &str, package: &str) -> PathBuf {
    let profile_dir = own_profile_dir();
    let find = || {
        candidates(profile_dir.as_deref(), name)
            .into_iter()
            .find(|p| p.is_file())
    };
    if let Some(bin) = find() {
        return bin;
    }
    cargo_build(name, package);
    find().unwrap_or_else(|| {
        panic!(
            "strata-testkit: {name} missing after the build (looked in {:?})",
            candidates(profile_dir.as_deref(), name)
        )
    })
}

/// `cargo build -p <package> --bin <name>`, with `--release` when this
/// process runs from a release directory. Panics when the build fails.
fn cargo_build(name: &str, package: &str) {
    let release = own_profile_dir()
        .as_deref()
        .and_then(Path::file_name)
        .is_some_and(|n| n == "release");
    eprintln!("strata-testkit: building {name} (cargo build -p {package})");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", package, "--bin", name]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .current_dir(crate::workspace_root())
        .status()
        .unwrap_or_else(|e| panic!("strata-testkit: cannot run cargo: {e}"));
    assert!(
        status.success(),
        "strata-testkit: cargo build -p {package} failed: {status}"
    );
}

/// Whether `bin` is older than a file under `src/` or the `Cargo.toml` of
/// one of `crates` (or has no modification time).
pub(crate) fn older_than_sources(bin: &Path, crates: &[&str]) -> bool {
    let Some(built) = bin.metadata().and_then(|m| m.modified()).ok() else {
        return true;
    };
    let root = crate::workspace_root().join("crates");
    crates
        .iter()
        .flat_map(|c| [root.join(c).join("src"), root.join(c).join("Cargo.toml")])
        .filter_map(|p| newest_mtime(&p))
        .any(|t| t > built)
}

/// Newest modification time of `path` (a file, or the files under a directory).
fn newest_mtime(path: &Path) -> Option<SystemTime> {
    let meta = path.metadata().ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|e| newest_mtime(&e.path()))
        .max()
}

/// Where to look for `name`, in order, without repeats.
fn candidates(profile_dir: Option<&Path>, name: &str) -> Vec<PathBuf> {
    let target = target_dir();
    let mut out: Vec<PathBuf> = Vec::new();
    let dirs = profile_dir
        .map(Path::to_path_buf)
        .into_iter()
        .chain(["debug", "release"].map(|p| target.join(p)));
    for d in dirs {
        let p = d.join(name);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// The profile directory of the running executable: `<target>/<profile>`
/// for a test binary in `<target>/<profile>/deps/`, an example in
/// `<target>/<profile>/examples/`, or a binary right in `<target>/<profile>/`.
fn own_profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    match dir.file_name()?.to_str()? {
        "deps" | "examples" => dir.parent().map(Path::to_path_buf),
        _ => Some(dir.to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_put_the_own_profile_first_and_repeat_nothing() {
        let target = target_dir();
        let own = target.join("debug");
        let c = candidates(Some(&own), "stratad");
        assert_eq!(
            c,
            vec![target.join("debug/stratad"), target.join("release/stratad")]
        );
        let c = candidates(Some(Path::new("/elsewhere/release")), "strata");
        assert_eq!(c[0], PathBuf::from("/elsewhere/release/strata"));
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn a_binary_older_than_its_sources_is_stale() {
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("stratad");
        assert!(older_than_sources(&bin, &["strata-testkit"]));
        std::fs::write(&bin, "").unwrap();
        let set = |t: SystemTime| {
            std::fs::File::options()
                .write(true)
                .open(&bin)
                .unwrap()
                .set_modified(t)
                .unwrap()
        };
        set(SystemTime::now() + std::time::Duration::from_secs(3600));
        assert!(!older_than_sources(&bin, &["strata-testkit"]));
        set(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1));
        assert!(older_than_sources(&bin, &["strata-testkit"]));
        assert!(!older_than_sources(&bin, &["no-such-crate"]));
    }

    #[test]
    fn a_test_binary_runs_from_its_profile_dir() {
        let dir = own_profile_dir().expect("profile dir");
        assert!(dir.join("deps").is_dir(), "{}", dir.display());
    }
}
