//! `build` and `load`: the cache protocol around the steps.
//!
//! An image lives in `<cache_dir>/<hash prefix>/`. It is assembled in a
//! `.build-*` directory next to it and renamed into place after its
//! manifest is written, so a directory with that name is always complete.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::ImageError;
use crate::kernel;
use crate::lock::Lock;
use crate::manifest::{
    BuiltImage, FileSizes, Manifest, DEFAULT_CMDLINE, INITRD_FILE, KERNEL_FILE, MANIFEST_FILE,
    MANIFEST_VERSION, ROOTFS_FILE, VMLINUX_FILE,
};
use crate::progress::{Progress, Step};
use crate::recipe::{image_hash, sha256_hex, HashInputs, ImageRecipe, RECIPE_VERSION};
use crate::tools;
use crate::{initramfs, rootfs};

/// Default cache directory, shared by every build on the machine.
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/strata/images";

/// Length of the hash prefix naming an image directory.
const DIR_HASH_LEN: usize = 32;

/// The default cache directory: `$STRATA_IMAGE_CACHE` if set, else [`DEFAULT_CACHE_DIR`].
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("STRATA_IMAGE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE_DIR))
}

/// Builds the image described by `recipe` into `cache_dir`, or returns the
/// cached one with the same hash. `progress` is called for every step and
/// for the output lines of the long-running tools.
pub fn build(
    recipe: &ImageRecipe,
    cache_dir: &Path,
    progress: &dyn Fn(Progress),
) -> Result<BuiltImage, ImageError> {
    let start = Instant::now();
    let report = |step: Step, detail: &str| {
        progress(Progress {
            step,
            detail: detail.to_string(),
            elapsed: start.elapsed(),
        })
    };
    validate(recipe)?;

    report(Step::Resolve, "hashing agent and busybox, resolving kernel");
    let agent_sha256 = agent_sha256(&recipe.agent_binary)?;
    let busybox = read_busybox(&recipe.busybox)?;
    let resolve_dir = tempfile::Builder::new()
        .prefix("strata-image-resolve-")
        .tempdir()
        .map_err(ImageError::io(
            "cannot create a temporary directory in",
            std::env::temp_dir(),
        ))?;
    let _ = fs::create_dir_all(cache_dir);
    let memo = cache_dir.join(format!(".kernel-{}.json", recipe.kernel_flavour));
    let k = kernel::resolve_memo(&recipe.kernel_flavour, &memo, resolve_dir.path(), &|l| {
        report(Step::Resolve, l)
    })?;
    let inputs = HashInputs {
        recipe_version: RECIPE_VERSION,
        agent_sha256,
        busybox_sha256: sha256_hex(&busybox),
        kernel_version: k.version.clone(),
        kernel_package_version: k.package_version.clone(),
    };
    let hash = image_hash(recipe, &inputs);
    let short = &hash[..DIR_HASH_LEN];
    let dir = cache_dir.join(short);
    report(
        Step::Resolve,
        &format!(
            "kernel {} ({}), image {short}",
            k.version, k.package_version
        ),
    );

    if let Some(img) = load_matching(&dir, &hash) {
        report(Step::CacheHit, &dir.display().to_string());
        return Ok(img);
    }
    fs::create_dir_all(cache_dir).map_err(ImageError::io("cannot create", cache_dir))?;
    let _lock = Lock::acquire(&cache_dir.join(format!(".{short}.lock")), &|l| {
        report(Step::Resolve, l)
    })?;
    if let Some(img) = load_matching(&dir, &hash) {
        report(
            Step::CacheHit,
            &format!("{} (built by another process)", dir.display()),
        );
        return Ok(img);
    }
    tools::require_all(tools::BUILD_TOOLS)?;
    let build_prefix = format!(".build-{short}-");
    rootfs::remove_stale(cache_dir, &build_prefix);
    let work = tempfile::Builder::new()
        .prefix(&build_prefix)
        .tempdir_in(cache_dir)
        .map_err(ImageError::io(
            "cannot create a temporary directory in",
            cache_dir,
        ))?;
    let out = work.path().join("image");
    fs::create_dir(&out).map_err(ImageError::io("cannot create", &out))?;

    // Kernel and initramfs (cached apart from the root fs: an agent change reuses them).
    let kernel_dir = kernel_stage(
        recipe,
        &k,
        &busybox,
        &inputs.busybox_sha256,
        cache_dir,
        &report,
    )?;
    let order: Vec<String> = fs::read_to_string(kernel_dir.join(MODULES_LIST))
        .map_err(ImageError::io("cannot read", kernel_dir.join(MODULES_LIST)))?
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    for name in [KERNEL_FILE, VMLINUX_FILE, INITRD_FILE] {
        let src = kernel_dir.join(name);
        if src.exists() {
            link_or_copy(&src, &out.join(name))?;
        }
    }
    let kernel_path = out.join(KERNEL_FILE);
    let vmlinux_path = out.join(VMLINUX_FILE);
    let initrd_path = out.join(INITRD_FILE);

    // Root file system.
    report(Step::Debootstrap, "looking for a cached debootstrap tree");
    let base = rootfs::ensure_base(recipe, cache_dir, &|l| report(Step::Debootstrap, l))?;
    report(
        Step::Debootstrap,
        &format!(
            "{} tree {} ({} packages)",
            if base.fresh { "built" } else { "cached" },
            base.root.display(),
            base.packages.len()
        ),
    );
    report(Step::RootFs, "copying tree, adding agent, user and config");
    let tree = work.path().join("tree");
    rootfs::copy_tree(&base.root, &tree)?;
    let agent = fs::read(&recipe.agent_binary).map_err(ImageError::io(
        "cannot read agent binary",
        &recipe.agent_binary,
    ))?;
    if sha256_hex(&agent) != inputs.agent_sha256 {
        return Err(ImageError::InvalidRecipe(format!(
            "agent binary {} changed during the build; build again",
            recipe.agent_binary.display()
        )));
    }
    rootfs::customize(&tree, &agent)?;
    report(
        Step::Filesystem,
        &format!("mkfs.ext4 {} GiB", recipe.rootfs_size_gib),
    );
    let rootfs_path = out.join(ROOTFS_FILE);
    rootfs::make_ext4(&tree, &rootfs_path, recipe.rootfs_size_gib, &hash, &|l| {
        report(Step::Filesystem, l)
    })?;
    remove_dir(&tree);

    // Manifest last, then the atomic rename.
    report(Step::Finish, "writing manifest");
    let size = |p: &Path| fs::metadata(p).map_err(ImageError::io("cannot stat", p));
    let rootfs_meta = size(&rootfs_path)?;
    let manifest = Manifest {
        manifest_version: MANIFEST_VERSION,
        hash: hash.clone(),
        recipe_version: RECIPE_VERSION,
        recipe: recipe.clone(),
        kernel_version: k.version.clone(),
        kernel_package: k.package.clone(),
        kernel_package_version: k.package_version.clone(),
        modules: order,
        packages: base.packages,
        agent_sha256: inputs.agent_sha256,
        busybox_sha256: inputs.busybox_sha256,
        sizes: FileSizes {
            kernel: size(&kernel_path)?.len(),
            vmlinux: fs::metadata(&vmlinux_path).map(|m| m.len()).unwrap_or(0),
            initrd: size(&initrd_path)?.len(),
            rootfs: rootfs_meta.len(),
            rootfs_allocated: rootfs_meta.blocks() * 512,
        },
        created: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        strata_version: env!("CARGO_PKG_VERSION").to_string(),
        cmdline: DEFAULT_CMDLINE.to_string(),
        build_seconds: start.elapsed().as_secs_f64(),
    };
    let manifest_path = out.join(MANIFEST_FILE);
    let json = serde_json::to_vec_pretty(&manifest).map_err(|source| ImageError::Manifest {
        path: manifest_path.clone(),
        source,
    })?;
    fs::write(&manifest_path, json).map_err(ImageError::io("cannot write", &manifest_path))?;
    sync_dir(&out);
    if dir.exists() {
        // An incomplete or foreign directory under our name: move it out of the way.
        let old = work.path().join("old");
        fs::rename(&dir, &old).map_err(ImageError::io("cannot move aside", &dir))?;
    }
    fs::rename(&out, &dir).map_err(ImageError::io("cannot rename into place", &dir))?;
    sync_dir(cache_dir);
    drop(work);
    let img = load(&dir)?;
    report(
        Step::Done,
        &format!(
            "{} (rootfs {} MiB allocated of {} GiB)",
            dir.display(),
            img.manifest.sizes.rootfs_allocated >> 20,
            recipe.rootfs_size_gib
        ),
    );
    Ok(img)
}

/// Name of the module load order file in a kernel stage directory.
const MODULES_LIST: &str = "modules.txt";

/// The kernel, uncompressed kernel and initramfs for `k`, the recipe's
/// modules and this busybox, in `<cache_dir>/kernel/<hash>/` (built there
/// through a temporary directory and a rename if missing).
fn kernel_stage(
    recipe: &ImageRecipe,
    k: &kernel::ResolvedKernel,
    busybox: &[u8],
    busybox_sha256: &str,
    cache_dir: &Path,
    report: &dyn Fn(Step, &str),
) -> Result<PathBuf, ImageError> {
    let key = serde_json::json!({
        "recipe_version": RECIPE_VERSION,
        "kernel_version": k.version,
        "kernel_package_version": k.package_version,
        "modules": recipe.modules,
        "busybox_sha256": busybox_sha256,
    });
    let key = sha256_hex(key.to_string().as_bytes());
    let short = &key[..DIR_HASH_LEN];
    let parent = cache_dir.join("kernel");
    fs::create_dir_all(&parent).map_err(ImageError::io("cannot create", &parent))?;
    let dir = parent.join(short);
    let _lock = Lock::acquire(&parent.join(format!(".{short}.lock")), &|l| {
        report(Step::Kernel, l)
    })?;
    if dir.join(MODULES_LIST).is_file() {
        report(
            Step::Kernel,
            &format!("cached kernel and initramfs {}", dir.display()),
        );
        return Ok(dir);
    }
    rootfs::remove_stale(&parent, &format!(".tmp-{short}-"));
    remove_dir(&dir);
    let work = tempfile::Builder::new()
        .prefix(&format!(".tmp-{short}-"))
        .tempdir_in(&parent)
        .map_err(ImageError::io(
            "cannot create a temporary directory in",
            &parent,
        ))?;
    let stage = work.path().join("stage");
    fs::create_dir(&stage).map_err(ImageError::io("cannot create", &stage))?;
    report(
        Step::Kernel,
        &format!("downloading {}={}", k.package, k.package_version),
    );
    let kx = kernel::fetch(k, &work.path().join("pkg"), &|l| report(Step::Kernel, l))?;
    let kernel_path = stage.join(KERNEL_FILE);
    fs::copy(&kx.vmlinuz, &kernel_path)
        .map_err(ImageError::io("cannot copy kernel to", &kernel_path))?;
    match kernel::extract_vmlinux(&kx.vmlinuz, work.path())? {
        Some(elf) => {
            let p = stage.join(VMLINUX_FILE);
            fs::write(&p, &elf).map_err(ImageError::io("cannot write", &p))?;
            report(
                Step::Kernel,
                &format!("extracted vmlinux ({} MiB, PVH entry)", elf.len() >> 20),
            );
        }
        None => report(
            Step::Kernel,
            "kernel payload is not xz: no vmlinux, boot vmlinuz",
        ),
    }
    let not_found = |module: String| ImageError::ModuleNotFound {
        module,
        kernel_version: k.version.clone(),
    };
    let order = kx.db.load_order(&recipe.modules).map_err(not_found)?;
    let mut modules = Vec::with_capacity(order.len());
    for name in &order {
        let rel = kx
            .db
            .paths
            .get(name)
            .ok_or_else(|| not_found(name.clone()))?;
        modules.push((
            name.clone(),
            kernel::read_module(&kx.modules_dir.join(rel))?,
        ));
    }
    report(
        Step::Initramfs,
        &format!("busybox + {} modules: {}", order.len(), order.join(" ")),
    );
    let initrd = initramfs::build(busybox, &modules)
        .map_err(ImageError::io("cannot build initramfs", &stage))?;
    let initrd_path = stage.join(INITRD_FILE);
    fs::write(&initrd_path, &initrd).map_err(ImageError::io("cannot write", &initrd_path))?;
    let list = stage.join(MODULES_LIST);
    fs::write(&list, order.join("\n") + "\n").map_err(ImageError::io("cannot write", &list))?;
    fs::rename(&stage, &dir).map_err(ImageError::io("cannot rename into place", &dir))?;
    Ok(dir)
}

/// Hard-links `src` to `dst` (same file system: the cache), else copies it.
fn link_or_copy(src: &Path, dst: &Path) -> Result<(), ImageError> {
    if fs::hard_link(src, dst).is_ok() {
        return Ok(());
    }
    fs::copy(src, dst)
        .map(|_| ())
        .map_err(ImageError::io("cannot copy to", dst))
}

/// Loads a built image from its directory, checking that the manifest
/// parses and that every file exists with the size the manifest records.
pub fn load(dir: &Path) -> Result<BuiltImage, ImageError> {
    let not = |reason: String| ImageError::NotAnImage {
        dir: dir.to_path_buf(),
        reason,
    };
    let manifest_path = dir.join(MANIFEST_FILE);
    let text =
        fs::read(&manifest_path).map_err(|e| not(format!("cannot read {MANIFEST_FILE}: {e}")))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|source| ImageError::Manifest {
            path: manifest_path.clone(),
            source,
        })?;
    let check = |name: &str, expected: u64| -> Result<PathBuf, ImageError> {
        let p = dir.join(name);
        let len = fs::metadata(&p)
            .map_err(|e| not(format!("{name}: {e}")))?
            .len();
        if expected != 0 && len != expected {
            return Err(not(format!(
                "{name} is {len} bytes, manifest says {expected}"
            )));
        }
        Ok(p)
    };
    let kernel = check(KERNEL_FILE, manifest.sizes.kernel)?;
    let kernel_pvh = match manifest.sizes.vmlinux {
        0 => None,
        n => Some(check(VMLINUX_FILE, n)?),
    };
    let initrd = check(INITRD_FILE, manifest.sizes.initrd)?;
    let rootfs = check(ROOTFS_FILE, manifest.sizes.rootfs)?;
    Ok(BuiltImage {
        dir: dir.to_path_buf(),
        kernel,
        kernel_pvh,
        initrd,
        rootfs,
        cmdline: if manifest.cmdline.is_empty() {
            DEFAULT_CMDLINE.to_string()
        } else {
            manifest.cmdline.clone()
        },
        hash: manifest.hash.clone(),
        kernel_version: manifest.kernel_version.clone(),
        manifest,
    })
}

fn load_matching(dir: &Path, hash: &str) -> Option<BuiltImage> {
    load(dir).ok().filter(|img| img.hash == hash)
}

fn validate(recipe: &ImageRecipe) -> Result<(), ImageError> {
    let bad = |m: &str| Err(ImageError::InvalidRecipe(m.to_string()));
    if recipe.suite.trim().is_empty() || recipe.suite.contains(['/', ' ']) {
        return bad("suite must be a Debian suite name such as `bookworm`");
    }
    if recipe.variant.trim().is_empty() || recipe.variant.contains(' ') {
        return bad("variant must be a debootstrap variant such as `minbase`");
    }
    if recipe.mirror.trim().is_empty() {
        return bad("mirror must be a URL such as `http://deb.debian.org/debian`");
    }
    if recipe.kernel_flavour.trim().is_empty() || recipe.kernel_flavour.contains([' ', '/']) {
        return bad("kernel_flavour must be a flavour such as `amd64`");
    }
    if recipe.packages().iter().any(|p| p.contains([',', ' '])) {
        return bad("package names must not contain commas or spaces");
    }
    if recipe.rootfs_size_gib == 0 || recipe.rootfs_size_gib > 1024 {
        return bad("rootfs_size_gib must be between 1 and 1024");
    }
    Ok(())
}

/// sha256 of the agent binary, with coreutils' `sha256sum` when present
/// (an unoptimised test build of this crate hashes 30 MB in seconds).
fn agent_sha256(path: &Path) -> Result<String, ImageError> {
    if path.as_os_str().is_empty() || !path.is_file() {
        return Err(ImageError::MissingAgent {
            path: path.to_path_buf(),
        });
    }
    if let Ok(out) = tools::run(
        tools::SHA256SUM,
        crate::os_args!["--", path],
        None,
        true,
        &|_| {},
    ) {
        if let Some(h) = out
            .stdout
            .get(..64)
            .and_then(|h| std::str::from_utf8(h).ok())
        {
            if h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(h.to_ascii_lowercase());
            }
        }
    }
    let bytes = fs::read(path).map_err(ImageError::io("cannot read agent binary", path))?;
    Ok(sha256_hex(&bytes))
}

fn read_busybox(path: &Path) -> Result<Vec<u8>, ImageError> {
    let missing = || ImageError::MissingTool {
        tool: path.display().to_string(),
        package: "busybox-static",
    };
    let bytes = fs::read(path).map_err(|_| missing())?;
    match elf_is_static(&bytes) {
        Some(true) => Ok(bytes),
        // A dynamically linked busybox (package `busybox`) cannot run in the initramfs.
        Some(false) | None => Err(missing()),
    }
}

/// Whether an x86-64 ELF has no program interpreter (PT_INTERP), i.e. is
/// statically linked. `None` if it is not a 64-bit little-endian ELF.
pub(crate) fn elf_is_static(b: &[u8]) -> Option<bool> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| b.get(o..o + 2).map(|s| u16::from_le_bytes([s[0], s[1]]));
    let phoff = usize::try_from(u64::from_le_bytes(b.get(0x20..0x28)?.try_into().ok()?)).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let p_type = u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?);
        if p_type == 3 {
            return Some(false);
        }
    }
    Some(true)
}

fn remove_dir(p: &Path) {
    let _ = fs::remove_dir_all(p);
}

fn sync_dir(p: &Path) {
    if let Ok(f) = fs::File::open(p) {
        let _ = f.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_elf_detection() {
        if let Ok(bb) = fs::read("/bin/busybox") {
            assert_eq!(elf_is_static(&bb), Some(true));
        }
        let sh = fs::read("/bin/sh").unwrap();
        assert_eq!(elf_is_static(&sh), Some(false));
        assert_eq!(elf_is_static(b"#!/bin/sh\n"), None);
        assert_eq!(elf_is_static(&sh[..70]), None);
    }

    #[test]
    fn invalid_recipes_are_refused() {
        let mut r = ImageRecipe::new("/nonexistent");
        r.rootfs_size_gib = 0;
        assert!(matches!(validate(&r), Err(ImageError::InvalidRecipe(_))));
        let mut r = ImageRecipe::new("/nonexistent");
        r.include.push("a,b".into());
        assert!(matches!(validate(&r), Err(ImageError::InvalidRecipe(_))));
        assert!(validate(&ImageRecipe::new("/x")).is_ok());
    }

    #[test]
    fn missing_agent_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let r = ImageRecipe::new(dir.path().join("no-agent"));
        let err = build(&r, dir.path(), &|_| {}).unwrap_err();
        assert!(matches!(err, ImageError::MissingAgent { .. }), "{err}");
        assert!(err
            .to_string()
            .contains("cargo build --release -p strata-agent"));
    }

    #[test]
    fn missing_busybox_names_the_package() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agent");
        fs::write(&agent, b"x").unwrap();
        let mut r = ImageRecipe::new(&agent);
        r.busybox = dir.path().join("busybox");
        let err = build(&r, dir.path(), &|_| {}).unwrap_err();
        assert!(err.to_string().contains("busybox-static"), "{err}");
        // A dynamically linked binary is refused too.
        r.busybox = PathBuf::from("/bin/sh");
        assert!(matches!(
            build(&r, dir.path(), &|_| {}),
            Err(ImageError::MissingTool { .. })
        ));
    }

    #[test]
    fn load_refuses_incomplete_images() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            load(dir.path()),
            Err(ImageError::NotAnImage { .. })
        ));
        let m = Manifest {
            hash: "h".into(),
            sizes: FileSizes {
                kernel: 3,
                ..Default::default()
            },
            ..Default::default()
        };
        fs::write(
            dir.path().join(MANIFEST_FILE),
            serde_json::to_vec(&m).unwrap(),
        )
        .unwrap();
        fs::write(dir.path().join(KERNEL_FILE), b"abcd").unwrap();
        fs::write(dir.path().join(INITRD_FILE), b"").unwrap();
        fs::write(dir.path().join(ROOTFS_FILE), b"").unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(err.to_string().contains("manifest says 3"), "{err}");
        fs::write(dir.path().join(KERNEL_FILE), b"abc").unwrap();
        let img = load(dir.path()).unwrap();
        assert_eq!(img.cmdline, DEFAULT_CMDLINE);
        fs::write(dir.path().join(MANIFEST_FILE), b"{not json").unwrap();
        assert!(matches!(load(dir.path()), Err(ImageError::Manifest { .. })));
    }
}
