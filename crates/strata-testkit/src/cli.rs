//! The `strata` CLI run against a daemon under test, the way a user runs it,
//! with what it did printed for the test log.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the CLI `bin` (`strata`) with `args` against the API at `url` with
/// `token` (none: no token at all), hermetically: no `STRATA_TOKEN` from the
/// environment, no fallback to a host's `/var/lib/strata/admin.token`
/// (`STRATA_DATA_DIR` names a directory that does not exist), stdin closed.
/// Prints `$ strata ARGS`, the exit code, stdout and stderr to stderr.
///
/// Panics if the binary cannot be run.
pub fn run_strata(bin: &Path, url: &str, token: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin);
    cmd.env("STRATA_URL", url)
        .env_remove("STRATA_TOKEN")
        .env("STRATA_DATA_DIR", "/nonexistent/strata-testkit")
        .stdin(Stdio::null());
    if let Some(t) = token {
        cmd.env("STRATA_TOKEN", t);
    }
    let out = cmd
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("strata-testkit: cannot run {}: {e}", bin.display()));
    eprintln!(
        "$ strata {}\n  exit {:?}\n  stdout: {}\n  stderr: {}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    out
}
