//! `--init`: PID 1 duties in the guest. Mounts the API file systems
//! (including `/dev/shm`), raises the open-file limit, sets the hostname, brings up `lo` (and eth0 if `ip` exists),
//! stops the legacy PIT when the kernel does not use it, then forks the real
//! agent and reaps orphans forever, restarting the agent if it dies.

use std::ffi::CString;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn cstr(s: &str) -> Option<CString> {
    CString::new(s).ok()
}

fn is_mountpoint(target: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(target))
        })
        .unwrap_or(false)
}

fn mount(src: &str, target: &str, fstype: &str, flags: libc::c_ulong, data: &str) {
    if target != "/proc" && is_mountpoint(target) {
        return;
    }
    if target == "/proc" && Path::new("/proc/self").exists() {
        return;
    }
    let _ = std::fs::create_dir_all(target);
    let (Some(s), Some(t), Some(f), Some(d)) = (cstr(src), cstr(target), cstr(fstype), cstr(data))
    else {
        return;
    };
    // SAFETY: all pointers are valid NUL-terminated strings for the call.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            tracing::warn!(target, fstype, error = %e, "mount failed");
        }
    } else {
        tracing::info!(target, fstype, "mounted");
    }
}

fn set_hostname_from_file() {
    let Ok(h) = std::fs::read_to_string("/etc/hostname") else {
        return;
    };
    let h = h.trim();
    if h.is_empty() {
        return;
    }
    // SAFETY: pointer/length describe h's bytes.
    if unsafe { libc::sethostname(h.as_ptr().cast(), h.len()) } < 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "sethostname failed");
    }
}

/// Open-file limit every process inherits from PID 1 (the kernel's
/// default soft limit, 1024, is too small for build tools and servers).
pub const NOFILE_LIMIT: u64 = 65536;

/// Raises RLIMIT_NOFILE to [`NOFILE_LIMIT`] (soft and hard; the hard limit
/// only upwards, so a smaller `fs.nr_open` leaves it as it is).
fn raise_nofile() {
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: cur is a valid out-pointer for getrlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut cur) } < 0 {
        return;
    }
    let want = libc::rlimit {
        rlim_cur: NOFILE_LIMIT.max(cur.rlim_cur),
        rlim_max: NOFILE_LIMIT.max(cur.rlim_max),
    };
    // SAFETY: want is a valid rlimit for setrlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } < 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot raise RLIMIT_NOFILE");
    }
}

fn loopback_up() {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        tracing::warn!("cannot create socket to configure lo");
        return;
    }
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        ifr.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: fd is a socket, ifr a valid ifreq naming "lo"; the union field
    // read/written is ifru_flags as SIOC[GS]IFFLAGS define.
    unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) == 0 {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr) < 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "cannot bring up lo");
            }
        }
        libc::close(fd);
    }
}

fn find_ip() -> Option<&'static str> {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

fn network() {
    if !Path::new("/sys/class/net/eth0").exists() {
        return;
    }
    let Some(ip) = find_ip() else {
        tracing::info!("no `ip` binary; eth0 left unconfigured");
        return;
    };
    for args in [
        &["link", "set", "eth0", "up"][..],
        &["addr", "add", "10.0.2.15/24", "dev", "eth0"][..],
        &["route", "add", "default", "via", "10.0.2.2"][..],
    ] {
        match Command::new(ip).args(args).status() {
            Ok(s) if s.success() => {}
            Ok(s) => tracing::warn!(?args, %s, "ip command failed"),
            Err(e) => tracing::warn!(?args, error = %e, "ip command failed"),
        }
    }
    let resolv = Path::new("/etc/resolv.conf");
    let has_ns = std::fs::read_to_string(resolv)
        .map(|s| s.contains("nameserver"))
        .unwrap_or(false);
    if !has_ns {
        if let Err(e) = std::fs::write(resolv, "nameserver 10.0.2.3\n") {
            tracing::warn!(error = %e, "cannot write /etc/resolv.conf");
        }
    }
}

/// Prepares the system as PID 1.
pub fn setup() {
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("proc", "/proc", "proc", nosuid_nodev_noexec, "");
    mount("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, "");
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755");
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "gid=5,mode=620,ptmxmode=666",
    );
    mount(
        "tmpfs",
        "/run",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=0755",
    );
    mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    );
    // POSIX shared memory (Python's `multiprocessing` needs it).
    mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    );
    raise_nofile();
    set_hostname_from_file();
    loopback_up();
    network();
    quiet_unused_pit();
}

/// The kernel's clock event devices (`/sys/devices/system/clockevents/*/current_device`).
fn clock_event_devices() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/clockevents") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("current_device")).ok())
        .map(|s| s.trim().to_owned())
        .collect()
}

/// Stops channel 0 of the i8254 PIT when no clock event device of the kernel
/// is the PIT (`pit`), as newer kernels do themselves (`clockevent_i8253_disable`).
///
/// On QEMU's `microvm` the guest kernel runs ACPI hardware-reduced, skips the
/// legacy timer set-up and never touches the PIT, which the firmware left
/// counting in mode 3 at 18.2 Hz: QEMU then wakes 36 times a second to toggle
/// an interrupt line nobody listens to (under TCG ~0.2 % of a host core per
/// idle guest, docs/bench/idle-cost.md). Programming mode 0 (interrupt on
/// terminal count) and a count ends that after one last count. The PIT's state
/// is part of the VM's device state, so templates made after this keep it quiet.
/// A kernel that uses the PIT (no local APIC timer) is left alone.
#[cfg(target_arch = "x86_64")]
fn quiet_unused_pit() {
    const PIT_CH0: u16 = 0x40;
    const PIT_MODE: u16 = 0x43;
    let devices = clock_event_devices();
    if devices.is_empty() || devices.iter().any(|d| d == "pit") {
        tracing::debug!(?devices, "PIT left as it is");
        return;
    }
    // SAFETY: ioperm only changes this process's I/O permission bitmap.
    if unsafe { libc::ioperm(u64::from(PIT_CH0), 4, 1) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "ioperm for the PIT refused");
        return;
    }
    let outb = |port: u16, val: u8| {
        // SAFETY: ioperm above granted ports 0x40..=0x43 (the PIT); writing
        // them has no effect on this process's memory.
        unsafe {
            std::arch::asm!("out dx, al", in("dx") port, in("al") val, options(nomem, nostack, preserves_flags))
        };
    };
    // The sequence of Linux's clockevent_i8253_disable: mode 0, a count (some
    // virtual PITs only apply the mode on a count write), mode 0 again.
    outb(PIT_MODE, 0x30);
    outb(PIT_CH0, 0);
    outb(PIT_CH0, 0);
    outb(PIT_MODE, 0x30);
    // SAFETY: as above; drops the permission again.
    unsafe { libc::ioperm(u64::from(PIT_CH0), 4, 0) };
    tracing::info!(?devices, "stopped the unused PIT (channel 0)");
}

#[cfg(not(target_arch = "x86_64"))]
fn quiet_unused_pit() {}

/// Forks the agent (`run_agent` in the child) and reaps children forever.
pub fn supervise(run_agent: impl Fn() -> i32) -> ! {
    loop {
        let started = Instant::now();
        // SAFETY: we are single-threaded here (no runtime started in PID 1).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            tracing::error!(error = %std::io::Error::last_os_error(), "fork failed");
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        if pid == 0 {
            let code = run_agent();
            // SAFETY: terminate the child without running PID 1's atexit handlers.
            unsafe { libc::_exit(code) };
        }
        tracing::info!(pid, "agent started");
        loop {
            let mut status = 0;
            // SAFETY: status is a valid out-pointer.
            let r = unsafe { libc::waitpid(-1, &mut status, 0) };
            if r < 0 {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            if r == pid {
                tracing::error!(pid, status, "agent exited; restarting");
                break;
            }
        }
        if started.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}
