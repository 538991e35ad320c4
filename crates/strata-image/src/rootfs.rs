//! The root file system: a cached `debootstrap` tree, a copy of it with
//! strata's files added, written into a sparse ext4 image by `mkfs.ext4 -d`.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::ImageError;
use crate::lock::Lock;
use crate::os_args;
use crate::recipe::{sha256_hex, ImageRecipe};
use crate::tools::{self, CP, DEBOOTSTRAP, DPKG_QUERY, MKFS_EXT4};

/// Name of the file, next to a cached tree, listing its packages.
const PACKAGES_FILE: &str = "packages.txt";

/// A debootstrap tree in the cache.
pub(crate) struct BaseTree {
    /// The root directory of the tree.
    pub root: PathBuf,
    /// `name version` lines of the installed packages.
    pub packages: Vec<String>,
    /// Whether it was built now (false: from the cache).
    pub fresh: bool,
}

/// Returns the cached debootstrap tree for the recipe's suite, mirror,
/// variant and packages, running debootstrap first if there is none.
/// The tree is built in a temporary directory and renamed into place.
pub(crate) fn ensure_base(
    recipe: &ImageRecipe,
    cache_dir: &Path,
    log: &dyn Fn(&str),
) -> Result<BaseTree, ImageError> {
    let short = &recipe.base_hash()[..32];
    let base_dir = cache_dir.join("base");
    fs::create_dir_all(&base_dir).map_err(ImageError::io("cannot create", &base_dir))?;
    let dir = base_dir.join(short);
    let _lock = Lock::acquire(&base_dir.join(format!(".{short}.lock")), log)?;
    if let Some(packages) = read_complete(&dir) {
        return Ok(BaseTree {
            root: dir.join("root"),
            packages,
            fresh: false,
        });
    }
    // Leftovers of a crashed build of this same tree (we hold its lock).
    remove_stale(&base_dir, &format!(".tmp-{short}-"));
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(ImageError::io("cannot remove incomplete", &dir))?;
    }
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".tmp-{short}-"))
        .tempdir_in(&base_dir)
        .map_err(ImageError::io(
            "cannot create a temporary directory in",
            &base_dir,
        ))?;
    let root = tmp.path().join("root");
    let include = format!("--include={}", recipe.packages().join(","));
    let variant = format!("--variant={}", recipe.variant);
    tools::run(
        DEBOOTSTRAP,
        os_args![
            "--components=main",
            variant,
            include,
            recipe.suite,
            root,
            recipe.mirror
        ],
        None,
        false,
        log,
    )?;
    // Downloaded .debs and apt's binary caches are not part of the system.
    clear_dir(&root.join("var/cache/apt/archives"), |n| {
        n.ends_with(".deb")
    })?;
    clear_dir(&root.join("var/cache/apt"), |n| n.ends_with(".bin"))?;
    let out = tools::run(
        DPKG_QUERY,
        os_args![
            "--admindir",
            root.join("var/lib/dpkg"),
            "-W",
            "-f",
            "${Package} ${Version}\\n"
        ],
        None,
        true,
        &|_| {},
    )?;
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let packages_path = tmp.path().join(PACKAGES_FILE);
    fs::write(&packages_path, &listing).map_err(ImageError::io("cannot write", &packages_path))?;
    let tmp_path = tmp.keep();
    fs::rename(&tmp_path, &dir).map_err(ImageError::io("cannot rename into place", &dir))?;
    let packages = listing.lines().map(str::to_string).collect();
    Ok(BaseTree {
        root: dir.join("root"),
        packages,
        fresh: true,
    })
}

fn read_complete(dir: &Path) -> Option<Vec<String>> {
    let text = fs::read_to_string(dir.join(PACKAGES_FILE)).ok()?;
    dir.join("root/usr/bin")
        .is_dir()
        .then(|| text.lines().map(str::to_string).collect())
}

/// Removes directories in `dir` whose names start with `prefix`.
pub(crate) fn remove_stale(dir: &Path, prefix: &str) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

fn clear_dir(dir: &Path, pred: impl Fn(&str) -> bool) -> Result<(), ImageError> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if pred(&name) && e.path().is_file() {
            fs::remove_file(e.path()).map_err(ImageError::io("cannot remove", e.path()))?;
        }
    }
    Ok(())
}

/// Copies the base tree to `tree` (reflinks where the file system can).
pub(crate) fn copy_tree(base: &Path, tree: &Path) -> Result<(), ImageError> {
    tools::run(
        CP,
        os_args!["-a", "--reflink=auto", base, tree],
        None,
        false,
        &|_| {},
    )?;
    Ok(())
}

/// The user the guest runs commands as by default.
pub const GUEST_USER: &str = "user";
/// Its uid and gid.
pub const GUEST_UID: u32 = 1000;

/// Adds strata's files to a copy of the base tree: the agent, host name,
/// hosts, resolver, the `user` account (with passwordless sudo) and an
/// empty machine-id.
pub(crate) fn customize(tree: &Path, agent: &[u8]) -> Result<(), ImageError> {
    let write = |rel: &str, data: &[u8], mode: u32| -> Result<(), ImageError> {
        let p = tree.join(rel);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(ImageError::io("cannot create", parent))?;
        }
        // Replace, never write through, a symlink (e.g. resolv.conf).
        if p.symlink_metadata().is_ok() {
            fs::remove_file(&p).map_err(ImageError::io("cannot replace", &p))?;
        }
        fs::write(&p, data).map_err(ImageError::io("cannot write", &p))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(ImageError::io("cannot chmod", &p))
    };
    write("usr/local/bin/strata-agent", agent, 0o755)?;
    write("etc/hostname", b"strata\n", 0o644)?;
    write(
        "etc/hosts",
        b"127.0.0.1\tlocalhost\n127.0.1.1\tstrata\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        0o644,
    )?;
    write("etc/resolv.conf", b"nameserver 10.0.2.3\n", 0o644)?;
    write("etc/machine-id", b"", 0o444)?;
    add_user(tree)?;
    // Passwordless sudo for the user, as in E2B's base template (sudo
    // ignores files in sudoers.d that are not 0440 or are writable by others).
    write(
        "etc/sudoers.d/90-strata-user",
        format!("{GUEST_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n").as_bytes(),
        0o440,
    )?;
    Ok(())
}

/// Appends `line` to `tree/rel` unless a line for `name` exists already,
/// keeping the file's mode.
fn append_entry(tree: &Path, rel: &str, name: &str, line: &str) -> Result<(), ImageError> {
    let p = tree.join(rel);
    let mut text = fs::read_to_string(&p).map_err(ImageError::io("cannot read", &p))?;
    let prefix = format!("{name}:");
    if text.lines().any(|l| l.starts_with(&prefix)) {
        return Ok(());
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    let mode = fs::metadata(&p)
        .map_err(ImageError::io("cannot stat", &p))?
        .mode();
    fs::write(&p, text).map_err(ImageError::io("cannot write", &p))?;
    fs::set_permissions(&p, fs::Permissions::from_mode(mode & 0o7777))
        .map_err(ImageError::io("cannot chmod", &p))
}

fn add_user(tree: &Path) -> Result<(), ImageError> {
    let (u, id) = (GUEST_USER, GUEST_UID);
    append_entry(
        tree,
        "etc/passwd",
        u,
        &format!("{u}:x:{id}:{id}:strata user:/home/{u}:/bin/bash"),
    )?;
    append_entry(tree, "etc/group", u, &format!("{u}:x:{id}:"))?;
    // Locked password: the agent starts processes as the user, nobody logs in.
    append_entry(tree, "etc/shadow", u, &format!("{u}:!:19000:0:99999:7:::"))?;
    if tree.join("etc/gshadow").exists() {
        append_entry(tree, "etc/gshadow", u, &format!("{u}:!::"))?;
    }
    let home = tree.join("home").join(u);
    fs::create_dir_all(&home).map_err(ImageError::io("cannot create", &home))?;
    let skel = tree.join("etc/skel");
    if let Ok(entries) = fs::read_dir(&skel) {
        for e in entries.flatten() {
            if e.path().is_file() {
                let dst = home.join(e.file_name());
                fs::copy(e.path(), &dst).map_err(ImageError::io("cannot copy to", &dst))?;
            }
        }
    }
    chown_recursive(&home, id)?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o755))
        .map_err(ImageError::io("cannot chmod", &home))
}

fn chown_recursive(path: &Path, id: u32) -> Result<(), ImageError> {
    std::os::unix::fs::lchown(path, Some(id), Some(id))
        .map_err(ImageError::io("cannot chown", path))?;
    if path.is_dir() && !path.is_symlink() {
        for e in fs::read_dir(path)
            .map_err(ImageError::io("cannot read", path))?
            .flatten()
        {
            chown_recursive(&e.path(), id)?;
        }
    }
    Ok(())
}

/// A UUID (8-4-4-4-12) derived from `seed`, so the same image hash gives the
/// same file system UUID and directory hash seed.
pub(crate) fn derived_uuid(seed: &str) -> String {
    let h = sha256_hex(seed.as_bytes());
    format!(
        "{}-{}-4{}-8{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

/// Writes `tree` into a new sparse ext4 image `out` of `size_gib` GiB.
pub(crate) fn make_ext4(
    tree: &Path,
    out: &Path,
    size_gib: u32,
    hash: &str,
    log: &dyn Fn(&str),
) -> Result<(), ImageError> {
    let uuid = derived_uuid(&format!("fs-uuid:{hash}"));
    let seed = derived_uuid(&format!("hash-seed:{hash}"));
    let ext = format!("root_owner=0:0,hash_seed={seed}");
    let size = format!("{size_gib}G");
    tools::run(
        MKFS_EXT4,
        os_args![
            "-q",
            "-F",
            "-L",
            "strata-root",
            "-U",
            uuid,
            "-E",
            ext,
            "-m",
            "1",
            "-d",
            tree,
            out,
            size
        ],
        None,
        false,
        log,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_uuid_is_stable_and_well_formed() {
        let a = derived_uuid("x");
        assert_eq!(a, derived_uuid("x"));
        assert_ne!(a, derived_uuid("y"));
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'));
    }

    #[test]
    fn customize_adds_user_and_files() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("not root: cannot chown the home directory; skipping");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path();
        fs::create_dir_all(t.join("etc/skel")).unwrap();
        fs::write(t.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        fs::write(t.join("etc/group"), "root:x:0:\n").unwrap();
        fs::write(t.join("etc/shadow"), "root:*:19000:0:99999:7:::").unwrap();
        fs::set_permissions(t.join("etc/shadow"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(t.join("etc/skel/.bashrc"), "# rc\n").unwrap();
        std::os::unix::fs::symlink(
            "/run/systemd/resolve/stub-resolv.conf",
            t.join("etc/resolv.conf"),
        )
        .unwrap();
        customize(t, b"agent").unwrap();
        customize(t, b"agent").unwrap(); // idempotent
        let passwd = fs::read_to_string(t.join("etc/passwd")).unwrap();
        assert_eq!(passwd.matches("user:x:1000:1000:").count(), 1);
        assert!(passwd.contains("/home/user:/bin/bash"));
        let shadow = fs::read_to_string(t.join("etc/shadow")).unwrap();
        assert!(shadow.contains("\nuser:!:"), "{shadow}");
        assert_eq!(
            fs::metadata(t.join("etc/shadow")).unwrap().mode() & 0o777,
            0o640
        );
        assert_eq!(
            fs::read(t.join("usr/local/bin/strata-agent")).unwrap(),
            b"agent"
        );
        assert_eq!(
            fs::read_to_string(t.join("etc/resolv.conf")).unwrap(),
            "nameserver 10.0.2.3\n"
        );
        assert_eq!(fs::read(t.join("etc/machine-id")).unwrap(), b"");
        assert!(t.join("home/user/.bashrc").is_file());
        let sudoers = t.join("etc/sudoers.d/90-strata-user");
        assert_eq!(
            fs::read_to_string(&sudoers).unwrap(),
            "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
        );
        assert_eq!(fs::metadata(&sudoers).unwrap().mode() & 0o777, 0o440);
    }
}
