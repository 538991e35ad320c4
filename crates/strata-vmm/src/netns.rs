//! The network namespace every QEMU runs in: one named, empty namespace
//! (`/run/netns/<name>`, as `ip netns add` makes it), joined by the child
//! between fork and exec (`setns(2)` in the driver's `pre_exec`).
//!
//! Guest egress and guest ports run over the agent's virtio-serial channel,
//! and QEMU's own sockets (QMP, agent, console) are unix sockets named by
//! path, so QEMU needs no host network at all. In a namespace that has
//! nothing but a loopback that is down, a compromised QEMU reaches no host
//! service (`127.0.0.1` listeners, cloud metadata), and the guest's
//! user-mode network (`-netdev user,restrict=on`, kept for the device
//! layout) has nowhere to go even if its restriction failed.
//!
//! The namespace is host-side only: it is not on QEMU's command line and not
//! in the device layout, so a VM restored from a snapshot made before it
//! existed restores the same.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::VmmError;

/// The name of the namespace the runtime puts its VMs in by default.
pub const DEFAULT_NETNS: &str = "strata-vm";

/// Where `ip netns` keeps named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// Checks a namespace name: 1–64 of `[A-Za-z0-9_.-]`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "network namespace name {name:?}: 1 to 64 of A-Z a-z 0-9 _ . - (not starting with .)"
        ))
    }
}

/// `/run/netns/<name>`.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// The namespace file of `name`, created empty (`ip netns add`) when it does
/// not exist yet. An existing namespace is used as it is.
pub fn ensure(name: &str) -> Result<PathBuf, VmmError> {
    validate_name(name).map_err(VmmError::InvalidSpec)?;
    let path = netns_path(name);
    if is_netns(&path) {
        return Ok(path);
    }
    let out = Command::new("ip")
        .args(["netns", "add", name])
        .output()
        .map_err(|e| VmmError::InvalidSpec(format!("cannot run `ip netns add {name}`: {e}")))?;
    if out.status.success() {
        tracing::info!(netns = name, "created the VMs' empty network namespace");
    }
    // Another process may be making it at the same moment (its file exists
    // before its bind mount does): give that a moment.
    for _ in 0..50 {
        if is_netns(&path) {
            return Ok(path);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Err(VmmError::InvalidSpec(format!(
        "{path:?} is not a network namespace (`ip netns add {name}`: {})",
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// Whether `path` is a network namespace file (a bind mount of an nsfs
/// inode, which `setns(CLONE_NEWNET)` accepts).
pub fn is_netns(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    use std::os::fd::AsRawFd as _;
    // SAFETY: ioctl NS_GET_NSTYPE takes no argument and only reads the
    // namespace of the valid, open descriptor `f`.
    let kind = unsafe { libc::ioctl(f.as_raw_fd(), NS_GET_NSTYPE) };
    kind == libc::CLONE_NEWNET
}

/// `NS_GET_NSTYPE` (linux/nsfs.h): `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Opens the namespace file for the child to join.
pub(crate) fn open(path: &Path) -> Result<OwnedFd, VmmError> {
    let f = std::fs::File::open(path).map_err(|e| VmmError::io(path, e))?;
    Ok(OwnedFd::from(f))
}

/// The inode of a process's network namespace (`/proc/<pid>/ns/net`).
pub fn netns_of(pid: u32) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/net"))?.ino())
}

/// The inode of the namespace a namespace file names.
pub fn netns_inode(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(std::fs::metadata(path)?.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for ok in ["strata-vm", "a", "x_1.2"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        assert!(!is_netns(Path::new("/nonexistent")));
        assert!(!is_netns(Path::new("/proc/self/status")));
        assert!(is_netns(Path::new("/proc/self/ns/net")));
    }
}
