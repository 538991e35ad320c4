//! Subvolume operations on any btrfs path, by ioctl (no `btrfs` process).
//!
//! [`crate::Pool`] wraps these with a check that the paths lie inside the pool;
//! use them directly only for paths you already know are on btrfs.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};
use crate::ioctl;

/// The file system type of `path` from `statfs(2)`: (`f_type`, a readable name).
pub fn fs_type(path: &Path) -> Result<(i64, String)> {
    let c = cpath(path)?;
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated string and `st` points to writable memory
    // of the size `statfs` fills.
    let r = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(StorageError::io("statfs", path, io::Error::last_os_error()));
    }
    // SAFETY: statfs returned 0, so it initialised the struct.
    let st = unsafe { st.assume_init() };
    // `f_type`'s C type differs between architectures (i64 on x86_64, u32 elsewhere).
    #[allow(clippy::unnecessary_cast)]
    let t = st.f_type as i64;
    Ok((t, fs_type_name(t)))
}

/// A readable name for a statfs `f_type` magic number.
pub fn fs_type_name(t: i64) -> String {
    match t {
        ioctl::BTRFS_SUPER_MAGIC => "btrfs".into(),
        0xEF53 => "ext2/ext3/ext4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x794C_7630 => "overlayfs".into(),
        0x6969 => "nfs".into(),
        0x2FC1_2FC1 => "zfs".into(),
        0x6573_5546 => "fuse".into(),
        0x9fa0 => "proc".into(),
        other => format!("unknown (f_type {other:#x})"),
    }
}

/// Fails with `NotBtrfs` unless `path` is on btrfs.
pub fn ensure_btrfs(path: &Path) -> Result<()> {
    let (t, name) = fs_type(path)?;
    if t != ioctl::BTRFS_SUPER_MAGIC {
        return Err(StorageError::NotBtrfs {
            path: path.to_path_buf(),
            fs_type: name,
        });
    }
    Ok(())
}

/// True if `path` is the root of a btrfs subvolume (a directory with inode 256 on btrfs).
pub fn is_subvolume(path: &Path) -> Result<bool> {
    let md = std::fs::symlink_metadata(path).map_err(|e| StorageError::io("stat", path, e))?;
    if !md.is_dir() || md.ino() != ioctl::FIRST_FREE_OBJECTID {
        return Ok(false);
    }
    Ok(fs_type(path)?.0 == ioctl::BTRFS_SUPER_MAGIC)
}

/// Creates an empty subvolume at `path` (`BTRFS_IOC_SUBVOL_CREATE`).
pub fn create_subvolume(path: &Path) -> Result<()> {
    let (parent, name) = split(path)?;
    let dir = open_dir(&parent)?;
    ensure_absent(path)?;
    let mut args = ioctl::VolArgs::zeroed();
    ioctl::fill_name(&mut args.name, name.as_bytes()).ok_or_else(|| bad_name(path))?;
    // SAFETY: BTRFS_IOC_SUBVOL_CREATE takes a `struct btrfs_ioctl_vol_args`, which
    // `VolArgs` reproduces (size checked in a unit test); `dir` is an open directory.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), ioctl::BTRFS_IOC_SUBVOL_CREATE, &mut *args) }
        .map_err(|e| StorageError::io("create subvolume", path, e))?;
    Ok(())
}

/// Snapshots subvolume `src` as a new subvolume `dst` (`BTRFS_IOC_SNAP_CREATE_V2`),
/// read-only if `readonly`.
///
/// The kernel writes back the source's dirty pages (including pages of files mapped
/// `MAP_SHARED` and written through the mapping) before it takes the snapshot, so the
/// snapshot holds everything written before the call. It is atomic: on error no
/// subvolume exists at `dst`.
pub fn snapshot(src: &Path, dst: &Path, readonly: bool) -> Result<()> {
    if !is_subvolume(src)? {
        return Err(StorageError::NotASubvolume {
            path: src.to_path_buf(),
        });
    }
    let (parent, name) = split(dst)?;
    let src_dir = open_dir(src)?;
    let dst_dir = open_dir(&parent)?;
    ensure_absent(dst)?;
    let mut args = ioctl::VolArgsV2::zeroed();
    args.fd = i64::from(std::os::fd::AsRawFd::as_raw_fd(&src_dir));
    args.flags = if readonly { ioctl::SUBVOL_RDONLY } else { 0 };
    ioctl::fill_name(&mut args.name, name.as_bytes()).ok_or_else(|| bad_name(dst))?;
    // SAFETY: BTRFS_IOC_SNAP_CREATE_V2 takes a `struct btrfs_ioctl_vol_args_v2`, which
    // `VolArgsV2` reproduces; `args.fd` is `src_dir`'s descriptor, open for the call.
    unsafe { ioctl::ioctl_ptr(dst_dir.as_fd(), ioctl::BTRFS_IOC_SNAP_CREATE_V2, &mut *args) }
        .map_err(|e| StorageError::io("snapshot", dst, e))?;
    Ok(())
}

/// Deletes subvolume `path` with everything in it (`BTRFS_IOC_SNAP_DESTROY`), read-only
/// or not. The space is freed in the background by the btrfs cleaner thread.
pub fn delete_subvolume(path: &Path) -> Result<()> {
    if !is_subvolume(path)? {
        return Err(StorageError::NotASubvolume {
            path: path.to_path_buf(),
        });
    }
    let (parent, name) = split(path)?;
    let dir = open_dir(&parent)?;
    let mut args = ioctl::VolArgs::zeroed();
    ioctl::fill_name(&mut args.name, name.as_bytes()).ok_or_else(|| bad_name(path))?;
    // SAFETY: BTRFS_IOC_SNAP_DESTROY takes a `struct btrfs_ioctl_vol_args`; `dir` is
    // the open parent directory of the subvolume named in it.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), ioctl::BTRFS_IOC_SNAP_DESTROY, &mut *args) }
        .map_err(|e| StorageError::io("delete subvolume", path, e))?;
    Ok(())
}

/// The subvolume flags (`BTRFS_IOC_SUBVOL_GETFLAGS`).
fn get_flags(path: &Path, dir: &File) -> Result<u64> {
    let mut flags: u64 = 0;
    // SAFETY: BTRFS_IOC_SUBVOL_GETFLAGS writes one `u64` through the pointer.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), ioctl::BTRFS_IOC_SUBVOL_GETFLAGS, &mut flags) }
        .map_err(|e| StorageError::io("get subvolume flags", path, e))?;
    Ok(flags)
}

/// True if subvolume `path` is read-only.
pub fn is_readonly(path: &Path) -> Result<bool> {
    subvol_dir(path)
        .and_then(|d| get_flags(path, &d))
        .map(|f| f & ioctl::SUBVOL_RDONLY != 0)
}

/// Makes subvolume `path` read-only or writable (`BTRFS_IOC_SUBVOL_SETFLAGS`).
pub fn set_readonly(path: &Path, readonly: bool) -> Result<()> {
    let dir = subvol_dir(path)?;
    let old = get_flags(path, &dir)?;
    let mut flags = if readonly {
        old | ioctl::SUBVOL_RDONLY
    } else {
        old & !ioctl::SUBVOL_RDONLY
    };
    if flags == old {
        return Ok(());
    }
    // SAFETY: BTRFS_IOC_SUBVOL_SETFLAGS reads one `u64` through the pointer.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), ioctl::BTRFS_IOC_SUBVOL_SETFLAGS, &mut flags) }
        .map_err(|e| StorageError::io("set subvolume flags", path, e))?;
    Ok(())
}

/// The btrfs id of the subvolume that contains `path` (`BTRFS_IOC_INO_LOOKUP`).
pub fn subvolume_id(path: &Path) -> Result<u64> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    let mut args = ioctl::InoLookupArgs::zeroed();
    args.objectid = ioctl::FIRST_FREE_OBJECTID;
    // SAFETY: BTRFS_IOC_INO_LOOKUP takes a `struct btrfs_ioctl_ino_lookup_args`; with
    // treeid 0 the kernel fills in the id of the subvolume `f` is in.
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_INO_LOOKUP, &mut *args) }
        .map_err(|e| StorageError::io("look up subvolume id", path, e))?;
    Ok(args.treeid)
}

/// Creates `dst` as a copy of regular file `src` that shares all its extents (`FICLONE`).
/// `dst` must not exist; on error it is removed again.
pub fn reflink_file(src: &Path, dst: &Path) -> Result<()> {
    let (s, md) = open_regular(src)?;
    let d = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(md.permissions().mode())
        .custom_flags(libc::O_CLOEXEC)
        .open(dst)
        .map_err(|e| StorageError::io("create", dst, e))?;
    if let Err(e) = ficlone(&s, &d, dst) {
        drop(d);
        let _ = std::fs::remove_file(dst);
        return Err(e);
    }
    Ok(())
}

/// Makes existing regular file `dst` share all extents of file `src`
/// (`FICLONE` onto it): `dst` keeps its inode (and so its identity for an
/// incremental send) and takes `src`'s contents and size.
pub fn reflink_over(src: &Path, dst: &Path) -> Result<()> {
    let (s, _) = open_regular(src)?;
    ficlone(&s, &open_existing_for_clone(dst)?, dst)
}

/// Opens `path` for reading, refusing anything but a regular file.
fn open_regular(path: &Path) -> Result<(File, std::fs::Metadata)> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    let md = f
        .metadata()
        .map_err(|e| StorageError::io("stat", path, e))?;
    if !md.is_file() {
        return Err(StorageError::InvalidArgument {
            what: path.display().to_string(),
            reason: "not a regular file".into(),
        });
    }
    Ok((f, md))
}

/// Opens existing file `path` to be cloned onto (not through a symlink).
pub(crate) fn open_existing_for_clone(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| StorageError::io("open", path, e))
}

/// `FICLONE`: `dst` (the file at `dst_path`) shares all of `src`'s extents.
pub(crate) fn ficlone(src: &File, dst: &File, dst_path: &Path) -> Result<()> {
    // SAFETY: FICLONE takes the source descriptor by value; `src` stays open for the call.
    unsafe {
        ioctl::ioctl_val(
            dst.as_fd(),
            ioctl::FICLONE,
            std::os::fd::AsRawFd::as_raw_fd(src) as _,
        )
    }
    .map_err(|e| StorageError::io("reflink", dst_path, e))?;
    Ok(())
}

/// Commits the current btrfs transaction of the file system holding `path` (`BTRFS_IOC_SYNC`).
pub fn sync_fs(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    // SAFETY: BTRFS_IOC_SYNC takes no argument.
    unsafe { ioctl::ioctl_val(f.as_fd(), ioctl::BTRFS_IOC_SYNC, 0) }
        .map_err(|e| StorageError::io("sync", path, e))?;
    Ok(())
}

/// Commits the running btrfs transaction of the file system holding `path`
/// and waits for it (`BTRFS_IOC_START_SYNC` + `BTRFS_IOC_WAIT_SYNC`), without
/// writing back any file's dirty data first (unlike [`sync_fs`], which writes
/// back every file of the pool). Returns the committed transaction's id.
///
/// What it is for: a snapshot commits the transaction it is created in, and
/// that commit writes every metadata change made since the last one (file
/// extents of all data written back meanwhile, pool-wide). Committing just
/// before a guest is paused leaves the snapshot's own commit only what
/// changed in between.
pub fn commit_transaction(path: &Path) -> Result<u64> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    let mut transid: u64 = 0;
    // SAFETY: BTRFS_IOC_START_SYNC writes one u64 (the transaction id) to its argument.
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_START_SYNC, &mut transid) }
        .map_err(|e| StorageError::io("start transaction commit", path, e))?;
    // SAFETY: BTRFS_IOC_WAIT_SYNC reads one u64 (the transaction id) from its argument.
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_WAIT_SYNC, &mut transid) }
        .map_err(|e| StorageError::io("wait for transaction commit", path, e))?;
    Ok(transid)
}

fn subvol_dir(path: &Path) -> Result<File> {
    if !is_subvolume(path)? {
        return Err(StorageError::NotASubvolume {
            path: path.to_path_buf(),
        });
    }
    open_dir(path)
}

pub(crate) fn open_dir(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| StorageError::io("open directory", path, e))
}

fn ensure_absent(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Err(StorageError::AlreadyExists {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io("stat", path, e)),
    }
}

/// Splits `path` into its parent directory and a plain final name.
pub(crate) fn split(path: &Path) -> Result<(PathBuf, &std::ffi::OsStr)> {
    let name = path.file_name().ok_or_else(|| bad_name(path))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if name.len() > 255 {
        return Err(bad_name(path));
    }
    Ok((parent, name))
}

fn bad_name(path: &Path) -> StorageError {
    StorageError::InvalidArgument {
        what: path.display().to_string(),
        reason: "needs a final component of 1..=255 bytes without NUL".into(),
    }
}

pub(crate) fn cpath(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| StorageError::InvalidArgument {
        what: path.display().to_string(),
        reason: "contains a NUL byte".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmp_is_not_btrfs_here() {
        // /tmp on the build machines is ext4 or tmpfs; if it ever is btrfs this test says so.
        let (t, name) = fs_type(Path::new("/tmp")).expect("statfs /tmp");
        if t != ioctl::BTRFS_SUPER_MAGIC {
            let e = ensure_btrfs(Path::new("/tmp")).expect_err("not btrfs");
            assert!(matches!(e, StorageError::NotBtrfs { .. }), "{e}");
            assert!(e.to_string().contains(&name));
        }
    }

    #[test]
    fn split_rejects_root_and_dotdot() {
        assert!(split(Path::new("/")).is_err());
        assert!(split(Path::new("/a/..")).is_err());
        let (p, n) = split(Path::new("/a/b")).expect("split");
        assert_eq!(
            (p.as_path(), n),
            (Path::new("/a"), std::ffi::OsStr::new("b"))
        );
    }

    #[test]
    fn plain_dir_is_not_a_subvolume() {
        let d = tempfile::tempdir().expect("tempdir");
        assert!(!is_subvolume(d.path()).expect("stat"));
        let e = snapshot(d.path(), &d.path().join("x"), true).expect_err("not a subvol");
        assert!(matches!(e, StorageError::NotASubvolume { .. }));
    }
}
