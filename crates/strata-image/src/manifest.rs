//! `manifest.json`: what an image directory contains and how it was made.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::recipe::ImageRecipe;

/// Version of the manifest's layout (independent of [`crate::RECIPE_VERSION`]).
pub const MANIFEST_VERSION: u32 = 1;

/// Kernel command line an image is booted with; the VMM driver may append to it.
/// `reboot=t panic=-1`: a guest panic or reboot ends the microVM at once.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 root=/dev/vda rw reboot=t panic=-1 quiet";

/// File names inside an image directory.
pub const KERNEL_FILE: &str = "vmlinuz";
/// The uncompressed kernel ELF with a PVH entry point (same kernel as `vmlinuz`).
pub const VMLINUX_FILE: &str = "vmlinux";
/// Initramfs file name.
pub const INITRD_FILE: &str = "initrd.img";
/// Root disk file name.
pub const ROOTFS_FILE: &str = "rootfs.ext4";
/// Manifest file name.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Sizes of an image's files, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileSizes {
    /// `vmlinuz`.
    pub kernel: u64,
    /// `vmlinux` (0: not extracted).
    pub vmlinux: u64,
    /// `initrd.img`.
    pub initrd: u64,
    /// `rootfs.ext4` apparent size (the disk size the guest sees).
    pub rootfs: u64,
    /// Bytes `rootfs.ext4` occupies on the host (it is sparse).
    pub rootfs_allocated: u64,
}

/// The content of `manifest.json`. Unknown fields are ignored and missing
/// ones default, so manifests of other versions still load.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`] of the writer.
    pub manifest_version: u32,
    /// The image hash (full sha256 hex).
    pub hash: String,
    /// The builder's [`crate::RECIPE_VERSION`].
    pub recipe_version: u32,
    /// The recipe it was built from.
    pub recipe: ImageRecipe,
    /// Kernel ABI version, e.g. `6.1.0-57-amd64`.
    pub kernel_version: String,
    /// Kernel package name.
    pub kernel_package: String,
    /// Kernel package version.
    pub kernel_package_version: String,
    /// Modules in the initramfs, in load order.
    pub modules: Vec<String>,
    /// Installed packages of the root file system, `name version`.
    pub packages: Vec<String>,
    /// sha256 of the agent binary.
    pub agent_sha256: String,
    /// sha256 of the busybox binary.
    pub busybox_sha256: String,
    /// File sizes.
    pub sizes: FileSizes,
    /// When the image was built (RFC 3339).
    pub created: String,
    /// Version of strata-image that built it.
    pub strata_version: String,
    /// Kernel command line to boot with.
    pub cmdline: String,
    /// Wall time of the build in seconds.
    pub build_seconds: f64,
}

/// A built image in the cache: paths to its files and its manifest.
#[derive(Debug, Clone)]
pub struct BuiltImage {
    /// The image directory.
    pub dir: PathBuf,
    /// `vmlinuz`.
    pub kernel: PathBuf,
    /// `vmlinux`: the same kernel uncompressed, booted through its PVH entry
    /// (`qemu -kernel vmlinux`). Prefer it under TCG: it skips the in-guest
    /// decompression of `vmlinuz` (about 8 s less to agent start on this
    /// machine). `None` if the kernel payload could not be extracted.
    pub kernel_pvh: Option<PathBuf>,
    /// `initrd.img`.
    pub initrd: PathBuf,
    /// `rootfs.ext4` (raw, sparse). Copy or reflink it before writing to it.
    pub rootfs: PathBuf,
    /// Kernel command line to boot with.
    pub cmdline: String,
    /// The image hash.
    pub hash: String,
    /// Kernel ABI version.
    pub kernel_version: String,
    /// The full manifest.
    pub manifest: Manifest,
}
