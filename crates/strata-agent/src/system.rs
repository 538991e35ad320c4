//! System-changing operations behind a trait, so that host tests can run the
//! agent with `--dry-system` without touching the host's clock or hostname.

use std::io;
use std::time::Duration;

use strata_proto::msg::{RestoreSync, MIN_RESTORE_ENTROPY};
use strata_proto::RemoteErrorKind;

use crate::error::Fail;

/// Guest-wide changes made by `restore_sync`.
pub trait System: Send + Sync {
    /// Adds `data` to the kernel entropy pool, credits it, and reseeds the CRNG.
    fn add_entropy(&self, data: &[u8]) -> io::Result<()>;
    /// Sets CLOCK_REALTIME.
    fn set_time(&self, unix_time_ns: u64) -> io::Result<()>;
    /// Sets the kernel hostname, `/etc/hostname` and the `127.0.1.1` line of `/etc/hosts`.
    fn set_hostname(&self, name: &str) -> io::Result<()>;
    /// Writes `/etc/machine-id`.
    fn set_machine_id(&self, id: &str) -> io::Result<()>;
}

/// The real thing (needs root in the guest).
pub struct RealSystem;

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG` = `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

impl System for RealSystem {
    fn add_entropy(&self, data: &[u8]) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/urandom")?;
        // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
        let words = data.len().div_ceil(4);
        let mut info = vec![0u32; 2 + words];
        let bits = i32::try_from(data.len() * 8)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        info[0] = bits as u32;
        info[1] = data.len() as u32;
        for (i, chunk) in data.chunks(4).enumerate() {
            let mut w = [0u8; 4];
            w[..chunk.len()].copy_from_slice(chunk);
            info[2 + i] = u32::from_ne_bytes(w);
        }
        // SAFETY: `info` is a properly laid out, 4-byte aligned rand_pool_info
        // whose buf holds buf_size bytes; the fd is open for the call.
        if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: RNDRESEEDCRNG takes no argument.
        if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
            let e = io::Error::last_os_error();
            tracing::warn!(error = %e, "RNDRESEEDCRNG failed (entropy was still added)");
        }
        Ok(())
    }

    fn set_time(&self, unix_time_ns: u64) -> io::Result<()> {
        let d = Duration::from_nanos(unix_time_ns);
        let ts = libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        // SAFETY: ts is a valid timespec.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn set_hostname(&self, name: &str) -> io::Result<()> {
        // SAFETY: pointer and length describe `name`'s bytes.
        if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        write_atomic("/etc/hostname", format!("{name}\n").as_bytes())?;
        // `/etc/hosts` names the sandbox (`127.0.1.1 <name>`), so tools
        // that resolve their own host name find it.
        let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
        write_atomic("/etc/hosts", hosts_with_name(&hosts, name).as_bytes())
    }

    fn set_machine_id(&self, id: &str) -> io::Result<()> {
        write_atomic("/etc/machine-id", format!("{id}\n").as_bytes())
    }
}

/// `hosts` with its `127.0.1.1` line naming `name` (replaced, or added
/// after the `localhost` line when there is none); other lines kept.
pub fn hosts_with_name(hosts: &str, name: &str) -> String {
    let line = format!("127.0.1.1\t{name}");
    let mut out = Vec::new();
    let mut done = false;
    for l in hosts.lines() {
        if l.split_whitespace().next() == Some("127.0.1.1") {
            if !done {
                out.push(line.clone());
                done = true;
            }
            continue;
        }
        out.push(l.to_owned());
    }
    if !done {
        let at = out
            .iter()
            .position(|l| l.split_whitespace().next() == Some("127.0.0.1"))
            .map_or(0, |i| i + 1);
        if out.is_empty() {
            out.push("127.0.0.1\tlocalhost".to_owned());
            out.push(line);
        } else {
            out.insert(at, line);
        }
    }
    let mut s = out.join("\n");
    s.push('\n');
    s
}

fn write_atomic(path: &str, data: &[u8]) -> io::Result<()> {
    let tmp = format!("{path}.strata-tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// Logs what it would do and changes nothing (`--dry-system`).
pub struct DrySystem;

impl System for DrySystem {
    fn add_entropy(&self, data: &[u8]) -> io::Result<()> {
        tracing::info!(bytes = data.len(), "dry-system: add_entropy");
        Ok(())
    }
    fn set_time(&self, unix_time_ns: u64) -> io::Result<()> {
        tracing::info!(unix_time_ns, "dry-system: set_time");
        Ok(())
    }
    fn set_hostname(&self, name: &str) -> io::Result<()> {
        tracing::info!(name, "dry-system: set_hostname");
        Ok(())
    }
    fn set_machine_id(&self, id: &str) -> io::Result<()> {
        tracing::info!(id, "dry-system: set_machine_id");
        Ok(())
    }
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 64
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with('-')
}

fn valid_machine_id(m: &str) -> bool {
    m.len() == 32 && m.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Validates and applies a [`RestoreSync`].
pub fn restore_sync(sys: &dyn System, req: &RestoreSync) -> Result<(), Fail> {
    let bad = |m: String| Fail::new(RemoteErrorKind::InvalidArgument, m);
    if req.entropy.len() < MIN_RESTORE_ENTROPY {
        return Err(bad(format!(
            "entropy must be at least {MIN_RESTORE_ENTROPY} bytes, got {}",
            req.entropy.len()
        )));
    }
    if req.entropy.len() > 4096 {
        return Err(bad("entropy must be at most 4096 bytes".into()));
    }
    if let Some(h) = &req.hostname {
        if !valid_hostname(h) {
            return Err(bad(format!("invalid hostname {h:?}")));
        }
    }
    if let Some(m) = &req.machine_id {
        if !valid_machine_id(m) {
            return Err(bad(format!(
                "invalid machine-id {m:?} (want 32 lowercase hex digits)"
            )));
        }
    }
    let io =
        |what: &str, e: io::Error| Fail::new(RemoteErrorKind::from_io(&e), format!("{what}: {e}"));
    sys.add_entropy(&req.entropy)
        .map_err(|e| io("adding entropy", e))?;
    sys.set_time(req.unix_time_ns)
        .map_err(|e| io("setting the clock", e))?;
    if let Some(h) = &req.hostname {
        sys.set_hostname(h)
            .map_err(|e| io("setting the hostname", e))?;
    }
    if let Some(m) = &req.machine_id {
        sys.set_machine_id(m)
            .map_err(|e| io("writing /etc/machine-id", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_the_sandbox() {
        let image = "127.0.0.1\tlocalhost\n127.0.1.1\tstrata\n::1\tlocalhost ip6-localhost\n";
        assert_eq!(
            hosts_with_name(image, "sbx-1"),
            "127.0.0.1\tlocalhost\n127.0.1.1\tsbx-1\n::1\tlocalhost ip6-localhost\n"
        );
        // Without a 127.0.1.1 line: added after localhost.
        assert_eq!(
            hosts_with_name("127.0.0.1 localhost\n10.0.0.9 db\n", "a"),
            "127.0.0.1 localhost\n127.0.1.1\ta\n10.0.0.9 db\n"
        );
        assert_eq!(
            hosts_with_name("", "a"),
            "127.0.0.1\tlocalhost\n127.0.1.1\ta\n"
        );
        // Idempotent.
        let once = hosts_with_name(image, "b");
        assert_eq!(hosts_with_name(&once, "b"), once);
    }

    #[test]
    fn validation() {
        let ok = RestoreSync {
            entropy: vec![7; 64],
            unix_time_ns: 1,
            hostname: Some("sbx-1.local".into()),
            machine_id: Some("0123456789abcdef0123456789abcdef".into()),
        };
        assert!(restore_sync(&DrySystem, &ok).is_ok());
        let mut r = ok.clone();
        r.entropy.truncate(63);
        assert!(restore_sync(&DrySystem, &r).is_err());
        let mut r = ok.clone();
        r.hostname = Some("bad host".into());
        assert!(restore_sync(&DrySystem, &r).is_err());
        let mut r = ok;
        r.machine_id = Some("XYZ".into());
        assert!(restore_sync(&DrySystem, &r).is_err());
    }
}
