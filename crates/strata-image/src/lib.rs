//! Builds strata's guest image from Debian packages only, reproducibly, and
//! caches it by a hash of its recipe.
//!
//! An image is a directory `<cache_dir>/<hash>/` with:
//! - `vmlinuz`: the kernel of Debian's `linux-image-<flavour>` (resolved
//!   through the metapackage, downloaded, never installed on the host);
//! - `vmlinux`: the same kernel uncompressed, bootable through its PVH entry
//!   (faster under TCG: no in-guest decompression);
//! - `initrd.img`: a gzip'd newc cpio with static busybox, the virtio / ext4
//!   modules in dependency order (from the package's `modules.dep`), and an
//!   `/init` that mounts `/dev/vda` and runs `strata-agent --init`;
//! - `rootfs.ext4`: a sparse ext4 image of a `debootstrap` tree plus the agent,
//!   a `user` account (uid 1000) and network config for QEMU user networking;
//! - `manifest.json`: the recipe, hash, kernel, packages, sizes, cmdline.
//!
//! ```no_run
//! use strata_image::{build, default_cache_dir, ImageRecipe};
//! let recipe = ImageRecipe::new("target/release/strata-agent");
//! let image = build(&recipe, &default_cache_dir(), &|p| eprintln!("{p}"))?;
//! println!("{} {}", image.kernel.display(), image.cmdline);
//! # Ok::<(), strata_image::ImageError>(())
//! ```

mod build;
mod cpio;
mod error;
mod initramfs;
mod kernel;
mod lock;
mod manifest;
mod modules;
mod progress;
mod recipe;
mod rootfs;
mod tools;

pub use build::{build, default_cache_dir, load, DEFAULT_CACHE_DIR};
pub use error::ImageError;
pub use initramfs::{AGENT_PATH, INIT_SCRIPT};
pub use manifest::{
    BuiltImage, FileSizes, Manifest, DEFAULT_CMDLINE, INITRD_FILE, KERNEL_FILE, MANIFEST_FILE,
    MANIFEST_VERSION, ROOTFS_FILE, VMLINUX_FILE,
};
pub use progress::{Progress, Step};
pub use recipe::{
    image_hash, HashInputs, ImageRecipe, DEFAULT_MODULES, DEFAULT_PACKAGES, RECIPE_VERSION,
};
pub use rootfs::{GUEST_UID, GUEST_USER};
