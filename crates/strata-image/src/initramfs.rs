//! The initramfs: static busybox, the kernel modules in load order, and an
//! `/init` script that mounts the root disk and hands over to the agent.

use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;

use crate::cpio::{Archive, Kind};

/// Where the initramfs keeps the modules and their load order.
pub const MODULES_DIR: &str = "lib/modules";
/// The agent inside the root file system, started by `/init`.
pub const AGENT_PATH: &str = "/usr/local/bin/strata-agent";

/// The `/init` script (busybox `sh`). Every line it prints carries the
/// seconds since kernel start, on the serial console.
pub const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
# strata initramfs: load modules, mount the root disk, start the agent.
/bin/busybox mkdir -p /proc /sys /dev /newroot /sbin /usr/bin /usr/sbin /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1

log() {
    read up _ </proc/uptime
    echo "[strata-init ${up}s] $*"
}

rescue() {
    log "ERROR: $*"
    log "dropping to a busybox shell on the console (strata agent NOT started)"
    exec setsid cttyhack sh
}

log "initramfs started (kernel $(uname -r))"

root=/dev/vda
rootfstype=ext4
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        root=*) root="${arg#root=}" ;;
        rootfstype=*) rootfstype="${arg#rootfstype=}" ;;
        strata.rescue) rescue "strata.rescue on the kernel command line" ;;
    esac
done

n=0
while read -r m; do
    [ -n "$m" ] || continue
    if insmod "/lib/modules/$m.ko"; then
        n=$((n + 1))
    else
        log "insmod $m failed"
    fi
done </lib/modules/order
log "loaded $n modules: $(tr '\n' ' ' </lib/modules/order)"

i=0
while [ ! -b "$root" ]; do
    i=$((i + 1))
    if [ "$i" -gt 100 ]; then
        rescue "root device $root did not appear within 5 s"
    fi
    sleep 0.05
done

mount -t "$rootfstype" -o rw "$root" /newroot || rescue "cannot mount $root ($rootfstype) on /newroot"
log "root $root mounted"

if [ ! -x "/newroot@AGENT@" ]; then
    rescue "agent @AGENT@ is missing from the root file system"
fi

log "starting @AGENT@ --init"
for fs in dev proc sys; do
    mkdir -p "/newroot/$fs"
    mount --move "/$fs" "/newroot/$fs" || log "cannot move /$fs into the new root"
done
exec switch_root /newroot @AGENT@ --init
"#;

/// The init script with the agent path filled in.
pub(crate) fn init_script() -> String {
    INIT_SCRIPT.replace("@AGENT@", AGENT_PATH)
}

/// Builds the gzip-compressed newc initramfs. `modules` are (name, bytes)
/// in load order. The same inputs always give the same bytes.
pub(crate) fn build(busybox: &[u8], modules: &[(String, Vec<u8>)]) -> std::io::Result<Vec<u8>> {
    let mut a = Archive::default();
    a.add("init", 0o755, Kind::File(init_script().into_bytes()));
    a.add("bin/busybox", 0o755, Kind::File(busybox.to_vec()));
    a.add("bin/sh", 0o777, Kind::Symlink("busybox".into()));
    a.add("dev/console", 0o600, Kind::CharDev(5, 1));
    a.add("dev/null", 0o666, Kind::CharDev(1, 3));
    for d in [
        "proc", "sys", "newroot", "sbin", "tmp", "usr/bin", "usr/sbin",
    ] {
        a.add(d, 0o755, Kind::Dir);
    }
    let mut order = String::new();
    for (name, bytes) in modules {
        a.add(
            &format!("{MODULES_DIR}/{name}.ko"),
            0o644,
            Kind::File(bytes.clone()),
        );
        order.push_str(name);
        order.push('\n');
    }
    a.add(
        &format!("{MODULES_DIR}/order"),
        0o644,
        Kind::File(order.into_bytes()),
    );
    // mtime 0 in the archive and in the gzip header: reproducible bytes.
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    a.write_to(&mut gz, 0)?;
    let mut out = gz.finish()?;
    out.flush()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initramfs_is_reproducible() {
        let mods = vec![
            ("virtio".to_string(), vec![1u8, 2, 3]),
            ("virtio_blk".to_string(), vec![4u8; 100]),
        ];
        let a = build(b"busybox", &mods).unwrap();
        let b = build(b"busybox", &mods).unwrap();
        assert_eq!(a, b);
        assert_eq!(&a[..2], &[0x1f, 0x8b]);
        let c = build(b"busybox2", &mods).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn init_script_starts_the_agent() {
        let s = init_script();
        assert!(s.starts_with("#!/bin/busybox sh\n"));
        assert!(s.contains("exec switch_root /newroot /usr/local/bin/strata-agent --init"));
        assert!(!s.contains("@AGENT@"));
    }
}
