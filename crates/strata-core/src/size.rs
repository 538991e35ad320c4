//! Sandbox sizes and the accelerator choice.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Upper bounds for a single sandbox, whatever the host. A request beyond
/// them is malformed, not merely too big for this host.
pub const MAX_VCPUS: u32 = 64;
/// Largest guest memory, in MiB (256 GiB).
pub const MAX_MEMORY_MIB: u32 = 256 * 1024;
/// Smallest guest memory, in MiB.
pub const MIN_MEMORY_MIB: u32 = 128;
/// Largest root disk, in GiB.
pub const MAX_DISK_GIB: u32 = 2048;

/// The resources of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSize {
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Root disk size in GiB.
    pub disk_gib: u32,
}

impl Default for SandboxSize {
    fn default() -> Self {
        Self {
            vcpus: 1,
            memory_mib: 512,
            disk_gib: 2,
        }
    }
}

/// A size outside the accepted bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// vCPU count outside `1..=MAX_VCPUS`.
    #[error("vcpus must be between 1 and {MAX_VCPUS}, got {0}")]
    Vcpus(u32),
    /// Memory outside `MIN_MEMORY_MIB..=MAX_MEMORY_MIB`.
    #[error("memory_mib must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}, got {0}")]
    Memory(u32),
    /// Disk outside `1..=MAX_DISK_GIB`.
    #[error("disk_gib must be between 1 and {MAX_DISK_GIB}, got {0}")]
    Disk(u32),
}

impl SandboxSize {
    /// Checks the size against the absolute bounds (not host capacity).
    pub fn validate(&self) -> Result<(), SizeError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(SizeError::Vcpus(self.vcpus));
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(SizeError::Memory(self.memory_mib));
        }
        if self.disk_gib == 0 || self.disk_gib > MAX_DISK_GIB {
            return Err(SizeError::Disk(self.disk_gib));
        }
        Ok(())
    }

    /// Guest memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        u64::from(self.memory_mib) * 1024 * 1024
    }

    /// Root disk in bytes.
    pub fn disk_bytes(&self) -> u64 {
        u64::from(self.disk_gib) * 1024 * 1024 * 1024
    }
}

/// Which accelerator runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Software emulation; works everywhere.
    Tcg,
    /// Hardware virtualization through `/dev/kvm`.
    Kvm,
    /// Probe KVM by booting a guest with a timeout; fall back to TCG.
    #[default]
    Auto,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
            Accel::Auto => "auto",
        })
    }
}

impl FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcg" => Ok(Accel::Tcg),
            "kvm" => Ok(Accel::Kvm),
            "auto" => Ok(Accel::Auto),
            other => Err(format!(
                "unknown accel {other:?}: expected tcg, kvm or auto"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        SandboxSize::default().validate().unwrap();
    }

    #[test]
    fn rejects_absurd_sizes() {
        let base = SandboxSize::default();
        let zero_cpu = SandboxSize { vcpus: 0, ..base };
        assert_eq!(zero_cpu.validate(), Err(SizeError::Vcpus(0)));
        let terabyte = SandboxSize {
            memory_mib: 1024 * 1024,
            ..base
        };
        assert_eq!(terabyte.validate(), Err(SizeError::Memory(1024 * 1024)));
        let no_disk = SandboxSize {
            disk_gib: 0,
            ..base
        };
        assert_eq!(no_disk.validate(), Err(SizeError::Disk(0)));
    }

    #[test]
    fn accel_parses() {
        assert_eq!("kvm".parse::<Accel>(), Ok(Accel::Kvm));
        assert!("xen".parse::<Accel>().is_err());
    }
}
