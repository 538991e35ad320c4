//! Data at rest: the daemon's files are its own user's only.
//!
//! At start ([`set_umask`], then [`harden`]) the process umask becomes 077,
//! so everything the daemon and its children create afterwards (the pool
//! image, the database and its `-wal`/`-shm`, the audit log, sandbox disks,
//! snapshots, logs) has no group or other bits; and the paths that exist
//! already get explicit modes: the data dir, the pool's mount point and its
//! top directories and the run dir `0700`, the pool image, the database
//! files and the audit log `0600`. A looser mode found there (an install
//! made before this, or a hand-made directory) is tightened and logged.
//!
//! Not covered: files outside these paths that an older daemon made inside
//! them keep their modes, but every one of them lies under the data dir (or
//! the run dir), which others can no longer enter.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use crate::config::Config;

/// Sets the process umask to 077 (owner-only files and directories from
/// now on, for this process and the processes it starts); returns the old.
pub fn set_umask() -> u32 {
    // SAFETY: umask(2) only swaps the process's file mode creation mask.
    let old = unsafe { libc::umask(0o077) };
    old as u32
}

/// Gives `path` exactly `mode` when it has bits `mode` lacks (group or
/// other ones, typically); a missing path is no error. Returns the old
/// mode when it changed. A symlink is left alone (its target is not ours
/// to judge).
pub fn tighten(path: &Path, mode: u32) -> std::io::Result<Option<u32>> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if meta.file_type().is_symlink() {
        return Ok(None);
    }
    let old = meta.permissions().mode() & 0o7777;
    if old & !mode == 0 {
        return Ok(None);
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(Some(old))
}

/// The paths [`harden`] gives a mode, with that mode.
pub fn owned_paths(cfg: &Config) -> Vec<(PathBuf, u32)> {
    let mut v = vec![(cfg.data_dir.clone(), 0o700), (cfg.run_dir(), 0o700)];
    if cfg.pool_path.is_none() {
        v.push((cfg.pool_image(), 0o600));
        v.push((cfg.pool_mount(), 0o700));
    }
    let pool_root = cfg.pool_path.clone().unwrap_or_else(|| cfg.pool_mount());
    for d in strata_storage::LAYOUT {
        v.push((pool_root.join(d), 0o700));
    }
    let db = cfg.db_path();
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = db.clone().into_os_string();
        p.push(suffix);
        v.push((PathBuf::from(p), 0o600));
    }
    v.push((cfg.data_dir.join("audit.jsonl"), 0o600));
    v
}

/// Gives every path of [`owned_paths`] its mode, logging each one that was
/// looser. Errors are logged, not fatal: a file that cannot be tightened
/// (a read-only mount, another owner) should not stop the daemon.
pub fn harden(cfg: &Config) -> usize {
    let mut tightened = 0;
    for (path, mode) in owned_paths(cfg) {
        match tighten(&path, mode) {
            Ok(Some(old)) => {
                tightened += 1;
                tracing::warn!(
                    path = %path.display(),
                    old = format!("{old:04o}"),
                    new = format!("{mode:04o}"),
                    "tightened a mode that let other users in"
                );
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot tighten the mode"),
        }
    }
    tightened
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn looser_modes_are_tightened_and_tight_ones_kept() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("strata.db");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(tighten(&f, 0o600).unwrap(), Some(0o644));
        assert_eq!(mode(&f), 0o600);
        assert_eq!(tighten(&f, 0o600).unwrap(), None);
        // Stricter than asked is fine as it is.
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(tighten(&f, 0o600).unwrap(), None);
        assert_eq!(mode(&f), 0o400);
        assert_eq!(tighten(&d.path().join("missing"), 0o600).unwrap(), None);
        let link = d.path().join("link");
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        assert_eq!(tighten(&link, 0o600).unwrap(), None);
    }

    #[test]
    fn the_owned_paths_cover_the_database_the_audit_log_and_the_pool() {
        let cfg = Config {
            data_dir: "/srv/s".into(),
            run_dir: "/run/s".into(),
            ..Config::default()
        };
        let paths = owned_paths(&cfg);
        for (p, m) in [
            ("/srv/s", 0o700),
            ("/run/s", 0o700),
            ("/srv/s/pool.img", 0o600),
            ("/srv/s/pool", 0o700),
            ("/srv/s/pool/sandboxes", 0o700),
            ("/srv/s/strata.db", 0o600),
            ("/srv/s/strata.db-wal", 0o600),
            ("/srv/s/strata.db-shm", 0o600),
            ("/srv/s/audit.jsonl", 0o600),
        ] {
            assert!(paths.contains(&(PathBuf::from(p), m)), "{p}");
        }
    }
}
