//! Host-process helpers: pidfds, memory accounting, file tails, the host TSC rate.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Opens a pidfd for `pid` (Linux ≥ 5.3). Works for children and non-children.
pub(crate) fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is shared.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "fd out of range"))?;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `sig` to the process behind `pidfd` (safe against pid reuse).
pub(crate) fn pidfd_send_signal(pidfd: &OwnedFd, sig: libc::c_int) -> std::io::Result<()> {
    // SAFETY: pidfd_send_signal reads only its scalar arguments; info is NULL.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        // ESRCH: already exited, which is what the caller wanted.
        if e.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Whether a process with `pid` exists (zombies included).
pub(crate) fn pid_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The NUL-separated `/proc/<pid>/cmdline`, joined with spaces.
pub(crate) fn proc_cmdline(pid: u32) -> std::io::Result<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    Ok(raw
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect::<Vec<_>>()
        .join(" "))
}

/// Every live QEMU whose QMP socket lies in a directory directly under
/// `root` (a runtime's run dir), as `(that directory, pid)`, found by its
/// command line (`-chardev socket,id=qmp,path=<root>/<name>/qmp.sock,…`)
/// rather than by a pid file: a process killed between QEMU's spawn and the
/// pid file's write, or a directory whose pid file is gone, still names its
/// VM. Zombies (empty command line) do not count.
pub fn qemus_under(root: &Path) -> Vec<(PathBuf, u32)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if let Some(dir) = qmp_run_dir(&raw, root) {
            found.push((dir, pid));
        }
    }
    found
}

/// The run dir named by a QEMU command line's QMP socket, if it lies
/// directly under `root`.
fn qmp_run_dir(cmdline: &[u8], root: &Path) -> Option<PathBuf> {
    const KEY: &str = "id=qmp,path=";
    cmdline.split(|&b| b == 0).find_map(|arg| {
        let arg = std::str::from_utf8(arg).ok()?;
        let at = arg.find(KEY)? + KEY.len();
        let path = arg[at..].split(',').next()?;
        let sock = Path::new(path);
        if sock.file_name()? != "qmp.sock" {
            return None;
        }
        let dir = sock.parent()?;
        (dir.parent()? == root).then(|| dir.to_path_buf())
    })
}

/// Reads at most the last `n` bytes of `path` (lossy UTF-8; empty if missing).
pub fn tail_file(path: &Path, n: usize) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(n as u64);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::with_capacity(n.min(1 << 20));
    let _ = f.take(n as u64).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last non-empty lines of `text`, at most `max` of them, joined by " | ".
pub(crate) fn last_lines(text: &str, max: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(max)..].join(" | ")
}

/// Resident memory of a QEMU process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RssInfo {
    /// `VmRSS`: everything resident.
    pub total: u64,
    /// `RssAnon`: QEMU's own heap, stacks, TCG translation cache.
    pub anon: u64,
    /// `RssFile`: file mappings (the guest RAM file when it is on a disk file system, binaries).
    pub file: u64,
    /// `RssShmem`: shared memory (the guest RAM file when it is on tmpfs).
    pub shmem: u64,
    /// Resident pages of the guest RAM mapping (from `/proc/<pid>/smaps`).
    pub guest_ram: u64,
}

impl RssInfo {
    /// What QEMU costs on top of the guest's RAM.
    pub fn beyond_guest_ram(&self) -> u64 {
        self.total.saturating_sub(self.guest_ram)
    }
}

fn kb_field(line: &str, key: &str) -> Option<u64> {
    let rest = line.strip_prefix(key)?.strip_prefix(':')?;
    let num = rest.split_whitespace().next()?.parse::<u64>().ok()?;
    Some(num * 1024)
}

/// `VmRSS` of this process, bytes (`None` when `/proc/self/status` cannot
/// be read).
pub fn self_rss() -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| kb_field(l, "VmRSS"))
}

/// Reads `/proc/<pid>/status` and `smaps` for `pid`; `mem_path` is the guest RAM file.
pub(crate) fn rss_info(pid: u32, mem_path: &Path) -> std::io::Result<RssInfo> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let mut info = RssInfo::default();
    for line in status.lines() {
        if let Some(v) = kb_field(line, "VmRSS") {
            info.total = v;
        } else if let Some(v) = kb_field(line, "RssAnon") {
            info.anon = v;
        } else if let Some(v) = kb_field(line, "RssFile") {
            info.file = v;
        } else if let Some(v) = kb_field(line, "RssShmem") {
            info.shmem = v;
        }
    }
    let mem = std::fs::canonicalize(mem_path).unwrap_or_else(|_| mem_path.to_path_buf());
    let mem = mem.to_string_lossy();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    info.guest_ram = guest_ram_rss(&smaps, &mem);
    Ok(info)
}

fn guest_ram_rss(smaps: &str, mem: &str) -> u64 {
    let mut in_mem = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // Header: "start-end perms offset dev inode [path]".
            let path = line.split_whitespace().nth(5).unwrap_or("");
            in_mem = path == mem;
        } else if in_mem {
            if let Some(v) = kb_field(line, "Rss") {
                total += v;
            }
        }
    }
    total
}

/// The host TSC rate in kHz, measured once per process (x86_64 only). Under TCG the
/// guest's TSC ticks at this rate.
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: OnceLock<Option<u64>> = OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    use std::time::{Duration, Instant};
    // SAFETY: rdtsc has no memory effects; it is available on every x86_64 CPU.
    let read = || unsafe { core::arch::x86_64::_rdtsc() };
    let mut best: Option<u64> = None;
    for _ in 0..3 {
        let t0 = Instant::now();
        let c0 = read();
        std::thread::sleep(Duration::from_millis(20));
        let c1 = read();
        let ns = t0.elapsed().as_nanos() as u64;
        if ns == 0 || c1 <= c0 {
            continue;
        }
        let khz = (c1 - c0) * 1_000_000 / ns;
        // Keep the smallest: a preemption between the two reads only inflates the interval's ns.
        best = Some(best.map_or(khz, |b: u64| b.min(khz)).max(1));
    }
    // Round to 1 MHz: calibration noise beyond that only confuses the guest.
    best.map(|k| (k + 500) / 1000 * 1000)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

/// The unprivileged user QEMU runs as by default (created by `scripts/setup.sh`).
pub const DEFAULT_VM_USER: &str = "strata-vm";

/// A host user's ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserIds {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// Looks a user up in the host's user database (`getpwnam_r`; NSS included).
pub fn lookup_user(name: &str) -> Option<UserIds> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut len = 4096usize;
    loop {
        let mut buf = vec![0 as libc::c_char; len];
        // SAFETY: `passwd` is a plain C struct; all-zero is a valid (empty) value.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer refers to memory owned by this frame and valid for the
        // call; `buf.len()` is the real size of `buf`; the result is read only if set.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        if rc == libc::ERANGE && len < (1 << 20) {
            len *= 4;
            continue;
        }
        if rc != 0 || result.is_null() {
            return None;
        }
        return Some(UserIds {
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        });
    }
}

/// [`DEFAULT_VM_USER`] when that user exists on this host, else `None` (QEMU then keeps
/// the daemon's user) with a warning, logged once per process.
pub fn default_vm_user() -> Option<String> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if lookup_user(DEFAULT_VM_USER).is_some() {
        return Some(DEFAULT_VM_USER.to_owned());
    }
    WARNED.call_once(|| {
        tracing::warn!(
            user = DEFAULT_VM_USER,
            "user does not exist: QEMU will run as the daemon's user; create it with scripts/setup.sh"
        );
    });
    None
}

/// Looks up `binary` like `execvp` would.
pub(crate) fn find_binary(binary: &Path) -> Option<PathBuf> {
    if binary.components().count() > 1 || binary.is_absolute() {
        return is_executable(binary).then(|| binary.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(binary))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_sum_only_counts_the_ram_file() {
        let smaps = "\
7f0000000000-7f0010000000 rw-s 00000000 fd:01 1234 /s/mem
Size:             262144 kB
Rss:               10240 kB
Pss:               10240 kB
7f0010000000-7f0010001000 rw-p 00000000 00:00 0
Rss:                   4 kB
55d000000000-55d000100000 r-xp 00000000 fd:01 99 /usr/bin/qemu-system-x86_64
Rss:                2048 kB
";
        assert_eq!(guest_ram_rss(smaps, "/s/mem"), 10240 * 1024);
    }

    #[test]
    fn users_are_looked_up() {
        assert_eq!(lookup_user("root"), Some(UserIds { uid: 0, gid: 0 }));
        assert_eq!(lookup_user("no-such-user-strata"), None);
        assert_eq!(lookup_user("nul\0byte"), None);
        assert_eq!(
            default_vm_user().is_some(),
            lookup_user(DEFAULT_VM_USER).is_some()
        );
    }

    #[test]
    fn own_process_rss_and_helpers() {
        let info = rss_info(std::process::id(), Path::new("/nonexistent")).unwrap();
        assert!(info.total > 0 && info.guest_ram == 0);
        assert_eq!(info.beyond_guest_ram(), info.total);
        assert!(find_binary(Path::new("sh")).is_some());
        assert!(find_binary(Path::new("no-such-binary-strata")).is_none());
        assert_eq!(last_lines("a\n\nb\nc\n", 2), "b | c");
        if cfg!(target_arch = "x86_64") {
            let khz = host_tsc_khz().unwrap();
            assert!(khz > 100_000, "{khz}");
        }
    }
}

#[cfg(test)]
mod scan_tests {
    use super::*;

    #[test]
    fn the_qmp_argument_names_the_run_dir() {
        let root = Path::new("/run/strata");
        let line = b"qemu-system-x86_64\0-name\0sb-1\0-chardev\0socket,id=qmp,path=/run/strata/sb-1/qmp.sock,server=on,wait=off\0";
        assert_eq!(
            qmp_run_dir(line, root).as_deref(),
            Some(Path::new("/run/strata/sb-1"))
        );
        let other = b"qemu\0-chardev\0socket,id=qmp,path=/elsewhere/sb-1/qmp.sock,server=on\0";
        assert_eq!(qmp_run_dir(other, root), None, "another runtime's VM");
        let deeper = b"qemu\0-chardev\0socket,id=qmp,path=/run/strata/a/b/qmp.sock\0";
        assert_eq!(qmp_run_dir(deeper, root), None);
        assert_eq!(qmp_run_dir(b"cat\0/run/strata/sb-1/qmp.sock\0", root), None);
    }

    #[test]
    fn a_scan_finds_a_process_by_its_command_line() {
        let root = std::env::temp_dir().join(format!("strata-scan-{}", std::process::id()));
        let arg = format!(
            "socket,id=qmp,path={}/sb-x/qmp.sock,server=on",
            root.display()
        );
        // The shell itself waits (on its stdin): no grandchild to outlive the test.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read x", &arg])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        // Until the child has exec'd, its command line is still ours: look
        // again for a while.
        let want = (root.join("sb-x"), child.id());
        let mut found = qemus_under(&root);
        for _ in 0..100 {
            if found.contains(&want) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            found = qemus_under(&root);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found.contains(&(root.join("sb-x"), child.id())),
            "{found:?}"
        );
    }
}
