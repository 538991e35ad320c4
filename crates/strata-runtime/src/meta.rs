//! Self-describing metadata stored as `meta.json` in every sandbox, snapshot
//! and template subvolume.
//!
//! JSON with `#[serde(default)]` on everything added after version 1 plus an
//! explicit [`SNAPSHOT_FORMAT_VERSION`], so snapshots written by older strata
//! keep loading; a snapshot that this host cannot restore (other QEMU, other
//! accelerator, other device layout, newer format) is refused with a reason
//! instead of a crashed guest.

use std::path::Path;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use strata_core::SandboxSize;
use strata_vmm::{NetSpec, VmSpec};

/// Version of the snapshot directory format this build writes for states
/// with memory (every template and snapshot but a disk-only one).
pub const SNAPSHOT_FORMAT_VERSION: u32 = 1;

/// Format of a disk-only state ([`StateMeta::disk_only`]: no `mem`, no
/// `device.state`; it cold-boots). A strata that reads only version 1
/// refuses it with a reason instead of failing on the missing files.
pub const DISK_ONLY_FORMAT_VERSION: u32 = 2;

/// Newest format this build reads.
pub const NEWEST_FORMAT_VERSION: u32 = DISK_ONLY_FORMAT_VERSION;

/// File names inside a state subvolume.
pub mod files {
    /// Guest RAM (memory-backend-file, share=on).
    pub const MEM: &str = "mem";
    /// Root disk (raw).
    pub const DISK: &str = "disk.img";
    /// QEMU device state (migration stream without RAM).
    pub const DEVICE_STATE: &str = "device.state";
    /// Kernel the guest was booted with (restores need the same bytes).
    pub const KERNEL: &str = "kernel";
    /// Initramfs the guest was booted with.
    pub const INITRD: &str = "initrd";
    /// This metadata.
    pub const META: &str = "meta.json";
    /// The deployment's signature of `meta.json` and `device.state`
    /// ([`crate::signing`]), written before the read-only snapshot is taken.
    pub const SIGNATURE: &str = "state.sig";
    /// A template cache entry's content record ([`crate::Runtime::export_template`]).
    pub const EXPORT_RECORD: &str = "export.json";
}

/// What a state subvolume holds and how it was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateMeta {
    /// [`SNAPSHOT_FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// strata release that wrote it.
    pub strata_version: String,
    /// `qemu-system-x86_64 --version` first line of the VM that ran it.
    pub qemu_version: String,
    /// `tcg` or `kvm`.
    pub accel: String,
    /// Hash of the VM's device layout (devices, machine, vCPUs, memory).
    pub machine_layout: String,
    /// Device layout version the VM was started under
    /// ([`strata_vmm::cmdline::MACHINE_LAYOUT_VERSION`] of the build that booted
    /// it): a restore builds that version's command line, so a state keeps its
    /// devices across upgrades. Absent (written before layouts were versioned): 1.
    #[serde(default = "first_layout")]
    pub layout_version: u32,
    /// Size of the VM.
    pub size: SandboxSize,
    /// Kernel command line it booted with.
    pub cmdline: String,
    /// Guest image hash.
    pub image_hash: String,
    /// Guest kernel version.
    #[serde(default)]
    pub kernel_version: String,
    /// User networking of the VM (must match on restore).
    #[serde(default)]
    pub net: NetSpec,
    /// Sandbox the state belongs to, if any (templates have none).
    #[serde(default)]
    pub sandbox: Option<String>,
    /// Template it descends from.
    #[serde(default)]
    pub template: Option<String>,
    /// Guest hostname.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Set on the wake snapshot of a sandbox created hibernated (never
    /// started): its first start gives the guest a new identity and runs with
    /// this size (the disk grows to it). Cleared in the sandbox once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_start: Option<SandboxSize>,
    /// A disk-only state (a hibernation without memory): the guest's file
    /// systems were synced and frozen, then the VM stopped; no RAM and no
    /// device state are kept. A start from it cold-boots the guest from its
    /// disk (kernel and initrd of the state). Written with
    /// [`DISK_ONLY_FORMAT_VERSION`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disk_only: bool,
    /// The recipe hash of a template built from a recipe (`strata-template`'s
    /// plan hash, the template's content identity): a recipe naming this
    /// template as its base chains on it. Inherited by every state made from
    /// the template; none for image-booted templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<String>,
    /// What a template's guest had started when it was published (each
    /// recipe's start command and ready check, the base's first): what a
    /// cold boot of its disk at another size (a size variant) runs again.
    /// `None` on image-booted templates (nothing to start) and on recipe
    /// templates published before this was kept (no variant can be made of
    /// those). Inherited like `recipe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts: Option<Vec<StartCommand>>,
    /// When this file was written.
    pub written_at: DateTime<Utc>,
}

/// A command as a template build ran it in the guest: `sh -c shell` as
/// `user` in `cwd`, with `env` added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestCommand {
    /// Passed to `sh -c`.
    pub shell: String,
    /// User name.
    pub user: String,
    /// Absolute working directory.
    pub cwd: String,
    /// Environment added.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
}

/// One recipe's start command (left running, in the background) and ready
/// check (run until it exits 0, for at most `ready_timeout_secs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartCommand {
    /// The command left running.
    #[serde(default)]
    pub start: Option<GuestCommand>,
    /// The probe.
    #[serde(default)]
    pub ready: Option<GuestCommand>,
    /// How long the probe may take to pass.
    #[serde(default)]
    pub ready_timeout_secs: u64,
}

fn first_layout() -> u32 {
    strata_vmm::cmdline::OLDEST_LAYOUT_VERSION
}

/// Hash of the device layout of `spec` (what must match between a VM and a restore).
pub fn layout_hash(spec: &VmSpec) -> String {
    let mut h = Sha256::new();
    for part in strata_vmm::cmdline::device_layout(spec) {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    hex::encode(&h.finalize()[..12])
}

/// QEMU's upstream version from a `qemu-system-* --version` first line:
/// `"QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18)"` →
/// `(7, 2, 22)`. The distribution's package string in parentheses is not
/// part of it.
pub fn qemu_upstream_version(line: &str) -> Option<(u32, u32, u32)> {
    let rest = line.split("version").nth(1)?.trim_start();
    let word = rest.split(|c: char| c.is_whitespace() || c == '(').next()?;
    let mut parts = word.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next()??;
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// Whether a state written under QEMU `taken` restores under QEMU `host`.
/// Judged on the upstream release series (major.minor): a stable or
/// distribution security update (7.2.21 → 7.2.22, Debian revision +deb12u17
/// → +deb12u18) keeps every snapshot restorable; another series does not
/// (the `microvm` machine has no versioned machine types that would carry
/// device state across series). Unparsable strings must match exactly.
pub fn same_qemu_series(taken: &str, host: &str) -> bool {
    match (qemu_upstream_version(taken), qemu_upstream_version(host)) {
        (Some((a, b, _)), Some((c, d, _))) => (a, b) == (c, d),
        _ => taken == host,
    }
}

/// Why a state subvolume cannot be restored here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Incompatible(pub String);

impl StateMeta {
    /// Reads `meta.json` from a state directory.
    pub fn read(dir: &Path) -> Result<StateMeta, Incompatible> {
        Self::read_with_bytes(dir).map(|(m, _)| m)
    }

    /// Reads `meta.json` from a state directory, with the exact bytes it
    /// was parsed from (what a signature covers).
    pub fn read_with_bytes(dir: &Path) -> Result<(StateMeta, Vec<u8>), Incompatible> {
        use std::io::Read;
        let path = dir.join(files::META);
        let mut bytes = Vec::new();
        std::fs::File::open(&path)
            .and_then(|f| f.take((1 << 20) + 1).read_to_end(&mut bytes))
            .map_err(|e| Incompatible(format!("cannot read {}: {e}", path.display())))?;
        if bytes.len() > 1 << 20 {
            return Err(Incompatible("meta.json is larger than 1 MiB".into()));
        }
        let meta = serde_json::from_slice(&bytes)
            .map_err(|e| Incompatible(format!("meta.json is not valid: {e}")))?;
        Ok((meta, bytes))
    }

    /// Writes `meta.json` atomically (temp file, fsync, rename).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = dir.join(".meta.json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(files::META))
    }

    /// Checks that a VM of this host (`qemu_version`, `accel`) can restore it, and that
    /// every file a restore needs is present and plausible.
    pub fn check_restorable(
        &self,
        dir: &Path,
        qemu_version: &str,
        accel: &str,
    ) -> Result<(), Incompatible> {
        if self.format_version > NEWEST_FORMAT_VERSION || self.format_version == 0 {
            return Err(Incompatible(format!(
                "snapshot format {} is not supported by this strata (reads 1..={NEWEST_FORMAT_VERSION})",
                self.format_version
            )));
        }
        if self.disk_only {
            // A cold boot: no device state to match, only the files it boots.
            for name in [files::DISK, files::KERNEL, files::INITRD] {
                match std::fs::metadata(dir.join(name)) {
                    Ok(m) if m.len() > 0 => {}
                    Ok(_) => return Err(Incompatible(format!("{name} is empty"))),
                    Err(_) => return Err(Incompatible(format!("{name} is missing"))),
                }
            }
            return Ok(());
        }
        if !same_qemu_series(&self.qemu_version, qemu_version) {
            return Err(Incompatible(format!(
                "taken under {:?}, this host runs {:?} (device state moves only within one QEMU release series)",
                self.qemu_version, qemu_version
            )));
        }
        if self.accel != accel {
            return Err(Incompatible(format!(
                "taken under accel {}, this host runs {}",
                self.accel, accel
            )));
        }
        let layouts = strata_vmm::cmdline::OLDEST_LAYOUT_VERSION
            ..=strata_vmm::cmdline::MACHINE_LAYOUT_VERSION;
        if !layouts.contains(&self.layout_version) {
            return Err(Incompatible(format!(
                "device layout version {} is not one this strata builds ({}..={})",
                self.layout_version,
                layouts.start(),
                layouts.end()
            )));
        }
        let need = [
            files::MEM,
            files::DISK,
            files::DEVICE_STATE,
            files::KERNEL,
            files::INITRD,
        ];
        for name in need {
            let p = dir.join(name);
            match std::fs::metadata(&p) {
                Ok(m) if m.len() > 0 => {}
                Ok(_) => return Err(Incompatible(format!("{name} is empty"))),
                Err(_) => return Err(Incompatible(format!("{name} is missing"))),
            }
        }
        let mem_len = std::fs::metadata(dir.join(files::MEM))
            .map(|m| m.len())
            .unwrap_or(0);
        if mem_len != self.size.memory_bytes() {
            return Err(Incompatible(format!(
                "mem is {mem_len} bytes, expected {}",
                self.size.memory_bytes()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 1-vCPU, 128 MiB state written under QEMU 7.2, TCG (shared with the
    /// runtime's unit tests).
    pub(crate) fn meta() -> StateMeta {
        StateMeta {
            format_version: 1,
            strata_version: "0.1.0".into(),
            qemu_version: "QEMU 7.2".into(),
            accel: "tcg".into(),
            machine_layout: "x".into(),
            layout_version: strata_vmm::cmdline::MACHINE_LAYOUT_VERSION,
            size: SandboxSize {
                vcpus: 1,
                memory_mib: 128,
                disk_gib: 1,
            },
            cmdline: String::new(),
            image_hash: "h".into(),
            kernel_version: String::new(),
            net: NetSpec::default(),
            sandbox: None,
            template: None,
            hostname: None,
            first_start: None,
            disk_only: false,
            recipe: None,
            starts: None,
            written_at: Utc::now(),
        }
    }

    #[test]
    fn a_disk_only_state_needs_no_memory_and_older_readers_refuse_it() {
        let d = tempfile::tempdir().unwrap();
        for f in [files::DISK, files::KERNEL, files::INITRD] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        let m = StateMeta {
            format_version: DISK_ONLY_FORMAT_VERSION,
            disk_only: true,
            ..meta()
        };
        m.check_restorable(d.path(), "QEMU 7.2", "tcg").unwrap();
        // The same files as a memory state: mem and device.state missing.
        let e = StateMeta {
            disk_only: false,
            ..m.clone()
        }
        .check_restorable(d.path(), "QEMU 7.2", "tcg")
        .unwrap_err();
        assert!(e.0.contains("missing"), "{e}");
        // A memory state's meta.json does not name the field at all.
        let text = serde_json::to_string(&meta()).unwrap();
        assert!(!text.contains("disk_only"), "{text}");
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains("\"disk_only\":true"), "{text}");
        assert!(serde_json::from_str::<StateMeta>(&text).unwrap().disk_only);
    }

    /// A directory holding every file a restore of [`meta`] needs.
    pub(crate) fn populated() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for f in [
            files::DISK,
            files::DEVICE_STATE,
            files::KERNEL,
            files::INITRD,
        ] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        let mem = std::fs::File::create(d.path().join(files::MEM)).unwrap();
        mem.set_len(128 << 20).unwrap();
        d
    }

    #[test]
    fn round_trip_and_restorable() {
        let d = populated();
        meta().write(d.path()).unwrap();
        let back = StateMeta::read(d.path()).unwrap();
        assert_eq!(back, meta_with_time(&back));
        back.check_restorable(d.path(), "QEMU 7.2", "tcg").unwrap();
    }

    fn meta_with_time(m: &StateMeta) -> StateMeta {
        StateMeta {
            written_at: m.written_at,
            ..meta()
        }
    }

    #[test]
    fn refuses_other_qemu_accel_format_and_missing_parts() {
        let d = populated();
        let m = meta();
        assert!(m.check_restorable(d.path(), "QEMU 8.0", "tcg").is_err());
        assert!(m.check_restorable(d.path(), "QEMU 7.2", "kvm").is_err());
        let newer = StateMeta {
            format_version: 99,
            ..meta()
        };
        let e = newer
            .check_restorable(d.path(), "QEMU 7.2", "tcg")
            .unwrap_err();
        assert!(e.0.contains("format 99"), "{e}");
        let future_layout = StateMeta {
            layout_version: strata_vmm::cmdline::MACHINE_LAYOUT_VERSION + 1,
            ..meta()
        };
        let e = future_layout
            .check_restorable(d.path(), "QEMU 7.2", "tcg")
            .unwrap_err();
        assert!(e.0.contains("device layout version"), "{e}");
        let first = StateMeta {
            layout_version: 1,
            ..meta()
        };
        first.check_restorable(d.path(), "QEMU 7.2", "tcg").unwrap();
        std::fs::remove_file(d.path().join(files::DEVICE_STATE)).unwrap();
        let e = m.check_restorable(d.path(), "QEMU 7.2", "tcg").unwrap_err();
        assert!(e.0.contains("device.state is missing"), "{e}");
    }

    #[test]
    fn qemu_compatibility_is_the_upstream_series_not_the_package_string() {
        let host = "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)";
        assert_eq!(qemu_upstream_version(host), Some((7, 2, 22)));
        assert_eq!(
            qemu_upstream_version("QEMU emulator version 8.0.0"),
            Some((8, 0, 0))
        );
        assert_eq!(
            qemu_upstream_version("QEMU emulator version 9.1"),
            Some((9, 1, 0))
        );
        assert_eq!(
            qemu_upstream_version("QEMU 7.2"),
            None,
            "no \"version\" word"
        );
        for other_revision in [
            "QEMU emulator version 7.2.21 (Debian 1:7.2+dfsg-7+deb12u17)",
            "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18)",
            "QEMU emulator version 7.2.23",
        ] {
            assert!(same_qemu_series(other_revision, host), "{other_revision}");
        }
        assert!(!same_qemu_series(
            "QEMU emulator version 8.0.4 (Debian 1:8.0)",
            host
        ));
        assert!(!same_qemu_series("QEMU emulator version 7.1.0", host));
        assert!(same_qemu_series("odd", "odd") && !same_qemu_series("odd", host));
        let d = populated();
        let m = StateMeta {
            qemu_version: "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u12)".into(),
            ..meta()
        };
        m.check_restorable(d.path(), host, "tcg")
            .expect("a security update of QEMU keeps the snapshot restorable");
        let e = StateMeta {
            qemu_version: "QEMU emulator version 8.2.2".into(),
            ..meta()
        }
        .check_restorable(d.path(), host, "tcg")
        .unwrap_err();
        assert!(e.0.contains("release series"), "{e}");
    }

    #[test]
    fn old_meta_without_new_fields_loads() {
        let d = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "format_version": 1, "strata_version": "0.0.1", "qemu_version": "q", "accel": "tcg",
            "machine_layout": "l", "size": {"vcpus": 1, "memory_mib": 128, "disk_gib": 1},
            "cmdline": "", "image_hash": "h", "written_at": "2026-01-01T00:00:00Z"
        });
        std::fs::write(d.path().join(files::META), json.to_string()).unwrap();
        let m = StateMeta::read(d.path()).unwrap();
        assert_eq!(m.sandbox, None);
        // Written before layouts were versioned: the first layout, restored
        // with the command line it was made under.
        assert_eq!(m.layout_version, 1);
    }
}
