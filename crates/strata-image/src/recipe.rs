//! What an image is made of, and the hash that names it in the cache.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Version of the builder's output format. Bump it whenever a change to this
/// crate changes the bytes of an image built from the same recipe (init script,
/// files added to the root, mkfs options …), so stale cache entries are not reused.
///
/// 2: E2B base-template conventions (`sudo`, `pip`, `python`, passwordless
/// sudo for `user`).
pub const RECIPE_VERSION: u32 = 2;

/// Packages added to the minbase root file system by default.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python-is-python3",
    "sudo",
    "ca-certificates",
    "curl",
    "git",
    "procps",
    "iproute2",
];

/// Kernel modules loaded by the initramfs by default, in the order they are
/// listed; their dependencies (from `modules.dep`) are loaded first whatever
/// this order says.
pub const DEFAULT_MODULES: &[&str] = &[
    "crc16",
    "crc32c_generic",
    "mbcache",
    "jbd2",
    "ext4",
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_rng",
];

/// How to build a guest image. Every field is part of the image's hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageRecipe {
    /// Debian suite for the root file system (e.g. `bookworm`).
    pub suite: String,
    /// Debian mirror debootstrap downloads from.
    pub mirror: String,
    /// debootstrap variant (`minbase`).
    pub variant: String,
    /// Extra packages installed into the root file system.
    pub include: Vec<String>,
    /// Kernel flavour: the kernel comes from `linux-image-<flavour>`'s dependency.
    pub kernel_flavour: String,
    /// Kernel modules put into the initramfs and loaded at boot (dependencies added automatically).
    pub modules: Vec<String>,
    /// Size of the (sparse) root disk image in GiB.
    pub rootfs_size_gib: u32,
    /// The guest agent binary installed as `/usr/local/bin/strata-agent`.
    pub agent_binary: PathBuf,
    /// The static busybox copied into the initramfs (from `busybox-static`).
    pub busybox: PathBuf,
}

impl Default for ImageRecipe {
    fn default() -> Self {
        ImageRecipe {
            suite: "bookworm".into(),
            mirror: "http://deb.debian.org/debian".into(),
            variant: "minbase".into(),
            include: DEFAULT_PACKAGES.iter().map(|s| s.to_string()).collect(),
            kernel_flavour: "amd64".into(),
            modules: DEFAULT_MODULES.iter().map(|s| s.to_string()).collect(),
            rootfs_size_gib: 2,
            agent_binary: PathBuf::new(),
            busybox: PathBuf::from("/bin/busybox"),
        }
    }
}

impl ImageRecipe {
    /// The default recipe (Debian bookworm minbase + the default packages and
    /// modules, 2 GiB root) with the given agent binary.
    pub fn new(agent_binary: impl Into<PathBuf>) -> Self {
        ImageRecipe {
            agent_binary: agent_binary.into(),
            ..ImageRecipe::default()
        }
    }

    /// The packages for debootstrap's `--include`, sorted and deduplicated.
    pub fn packages(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .include
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        p.sort();
        p.dedup();
        p
    }

    /// Hash of the fields that determine the debootstrap tree only
    /// (suite, mirror, variant, packages): changing the agent keeps it.
    pub fn base_hash(&self) -> String {
        let input = serde_json::json!({
            "recipe_version": RECIPE_VERSION,
            "suite": self.suite,
            "mirror": self.mirror,
            "variant": self.variant,
            "packages": self.packages(),
        });
        sha256_hex(input.to_string().as_bytes())
    }
}

/// Everything that determines an image's bytes, once the external inputs
/// (agent and busybox contents, resolved kernel) are known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashInputs {
    /// The builder's [`RECIPE_VERSION`].
    pub recipe_version: u32,
    /// sha256 of the agent binary.
    pub agent_sha256: String,
    /// sha256 of the busybox binary.
    pub busybox_sha256: String,
    /// Kernel ABI version (e.g. `6.1.0-57-amd64`).
    pub kernel_version: String,
    /// Debian package version of that kernel (e.g. `6.1.192-3`).
    pub kernel_package_version: String,
}

/// The image hash: sha256 over the recipe fields (paths excluded, contents
/// included through `inputs`) and the resolved inputs.
pub fn image_hash(recipe: &ImageRecipe, inputs: &HashInputs) -> String {
    let input = serde_json::json!({
        "recipe_version": inputs.recipe_version,
        "suite": recipe.suite,
        "mirror": recipe.mirror,
        "variant": recipe.variant,
        "packages": recipe.packages(),
        "kernel_flavour": recipe.kernel_flavour,
        "modules": recipe.modules,
        "rootfs_size_gib": recipe.rootfs_size_gib,
        "agent_sha256": inputs.agent_sha256,
        "busybox_sha256": inputs.busybox_sha256,
        "kernel_version": inputs.kernel_version,
        "kernel_package_version": inputs.kernel_package_version,
    });
    sha256_hex(input.to_string().as_bytes())
}

/// Hex sha256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> HashInputs {
        HashInputs {
            recipe_version: RECIPE_VERSION,
            agent_sha256: "aa".into(),
            busybox_sha256: "bb".into(),
            kernel_version: "6.1.0-57-amd64".into(),
            kernel_package_version: "6.1.192-3".into(),
        }
    }

    #[test]
    fn hash_is_stable() {
        let r = ImageRecipe::new("/x/strata-agent");
        let h = image_hash(&r, &inputs());
        assert_eq!(h, image_hash(&r.clone(), &inputs()));
        assert_eq!(h.len(), 64);
        // The agent's path is not part of the hash, its contents are.
        let moved = ImageRecipe::new("/elsewhere/strata-agent");
        assert_eq!(h, image_hash(&moved, &inputs()));
    }

    #[test]
    fn package_order_and_duplicates_do_not_matter() {
        let mut a = ImageRecipe::new("/a");
        let mut b = a.clone();
        a.include = vec!["git".into(), "curl".into()];
        b.include = vec!["curl".into(), "git".into(), "curl".into()];
        assert_eq!(image_hash(&a, &inputs()), image_hash(&b, &inputs()));
        assert_eq!(a.base_hash(), b.base_hash());
    }

    type Change = dyn Fn(&mut ImageRecipe, &mut HashInputs);

    #[test]
    fn hash_changes_with_every_input() {
        let r = ImageRecipe::new("/a");
        let base = image_hash(&r, &inputs());
        let variants: Vec<Box<Change>> = vec![
            Box::new(|r, _| r.suite = "trixie".into()),
            Box::new(|r, _| r.mirror = "http://mirror.example/debian".into()),
            Box::new(|r, _| r.variant = "buildd".into()),
            Box::new(|r, _| r.include.push("vim".into())),
            Box::new(|r, _| r.kernel_flavour = "cloud-amd64".into()),
            Box::new(|r, _| r.modules.push("9p".into())),
            Box::new(|r, _| r.modules.reverse()),
            Box::new(|r, _| r.rootfs_size_gib = 4),
            Box::new(|_, i| i.agent_sha256 = "ab".into()),
            Box::new(|_, i| i.busybox_sha256 = "bc".into()),
            Box::new(|_, i| i.kernel_version = "6.1.0-58-amd64".into()),
            Box::new(|_, i| i.kernel_package_version = "6.1.193-1".into()),
            Box::new(|_, i| i.recipe_version += 1),
        ];
        for (n, change) in variants.iter().enumerate() {
            let mut r2 = r.clone();
            let mut i2 = inputs();
            change(&mut r2, &mut i2);
            assert_ne!(
                base,
                image_hash(&r2, &i2),
                "change #{n} did not change the hash"
            );
        }
    }

    #[test]
    fn base_hash_ignores_agent_and_kernel() {
        let a = ImageRecipe::new("/a");
        let mut b = ImageRecipe::new("/b");
        b.modules.clear();
        b.rootfs_size_gib = 8;
        assert_eq!(a.base_hash(), b.base_hash());
        b.include.push("vim".into());
        assert_ne!(a.base_hash(), b.base_hash());
    }
}
