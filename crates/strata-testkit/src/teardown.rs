//! What a test or a benchmark leaves behind, and its removal: processes
//! found by pid (a daemon child, the QEMUs listed in a run directory), a
//! daemon's loop-mounted btrfs pool, the scratch root around them.
//!
//! Layout assumed of a daemon under test: `<run_dir>/<vm>/qemu.pid` for each
//! VM, `<data_dir>/pool.img` mounted on `<data_dir>/pool`; a scratch root
//! holds them as `<root>/run` and `<root>/data`.

use std::path::Path;
use std::time::{Duration, Instant};

/// How long a killed process may take to go, and a busy pool to unmount.
const WAIT: Duration = Duration::from_secs(10);

/// Whether `pid` runs and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

/// The command line of `pid`, arguments joined by spaces (empty when gone).
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// `(vm dir name, pid)` of the live QEMUs of `run_dir`: those listed in
/// `<run_dir>/*/qemu.pid` whose command line names `run_dir`, and any other
/// process whose command line names a `<run_dir>/<vm>/qmp.sock` (a QEMU
/// whose pid file was never written, or whose directory is gone). The
/// process table is read here directly, not through strata's own lookup,
/// so a test can judge it.
pub fn qemu_pids(run_dir: &Path) -> Vec<(String, u32)> {
    let ours = run_dir.to_string_lossy().into_owned();
    let mut found: Vec<(String, u32)> = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let text = std::fs::read_to_string(e.path().join("qemu.pid")).ok()?;
            let pid = text.trim().parse::<u32>().ok()?;
            (alive(pid) && cmdline(pid).contains(&ours))
                .then(|| (e.file_name().to_string_lossy().into_owned(), pid))
        })
        .collect();
    let prefix = format!("{ours}/");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !alive(pid) || found.iter().any(|(_, p)| *p == pid) {
            continue;
        }
        let line = cmdline(pid);
        let name = line.split([' ', ',', '=']).find_map(|w| {
            w.strip_prefix(&prefix)?
                .strip_suffix("/qmp.sock")
                .filter(|n| !n.contains('/'))
        });
        if let Some(name) = name {
            found.push((name.to_owned(), pid));
        }
    }
    found
}

/// `kill -9 pid`.
pub fn sigkill(pid: u32) {
    let Ok(pid) = i32::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) takes no pointer; callers pass a pid they started or
    // read from their own run directory.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Waits until `pid` is gone, at most `max`; whether it is.
pub fn wait_gone(pid: u32, max: Duration) -> bool {
    let t = Instant::now();
    while alive(pid) {
        if t.elapsed() >= max {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Kills the QEMUs of `run_dir` ([`qemu_pids`]) and waits until they are gone.
pub fn kill_qemus(run_dir: &Path) {
    let pids = qemu_pids(run_dir);
    for (_, pid) in &pids {
        sigkill(*pid);
    }
    for (_, pid) in pids {
        wait_gone(pid, WAIT);
    }
}

/// Unmounts the pool of a daemon's `data_dir` (`pool.img` on `pool`; a busy
/// mount is retried for a while) and detaches its loop devices. Whether the
/// pool is unmounted now (also when it never was mounted); the reason is
/// printed when not.
pub fn unmount_pool(data_dir: &Path) -> bool {
    let mnt = data_dir.join("pool");
    match strata_storage::unmount_image(&mnt, &data_dir.join("pool.img"), WAIT) {
        Ok(()) => true,
        Err(e) => {
            eprintln!(
                "strata-testkit teardown: {} stays mounted: {e}",
                mnt.display()
            );
            false
        }
    }
}

/// Removes the scratch `root` of a daemon: kills the QEMUs of `root/run`,
/// unmounts the pool of `root/data`, then deletes `root` — unless the pool
/// is still mounted (deleting through a mount would empty the pool and still
/// fail), in which case `root` stays.
pub fn remove_daemon_root(root: &Path) {
    kill_qemus(&root.join("run"));
    if unmount_pool(&root.join("data")) {
        let _ = std::fs::remove_dir_all(root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_by_pid() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(!cmdline(me).is_empty());
        assert!(!alive(u32::MAX));
        assert!(wait_gone(u32::MAX, Duration::ZERO));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        sigkill(child.id());
        let _ = child.wait();
        assert!(!alive(child.id()));
    }

    #[test]
    fn an_empty_root_is_removed_and_a_missing_run_dir_has_no_qemu() {
        let d = crate::scratch_dir("tk-root");
        let root = d.path().to_path_buf();
        std::fs::create_dir_all(root.join("data")).expect("data dir");
        assert!(qemu_pids(&root.join("run")).is_empty());
        remove_daemon_root(&root);
        assert!(!root.exists());
    }
}
