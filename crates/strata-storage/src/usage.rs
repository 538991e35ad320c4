//! Space accounting: per-subvolume exclusive / referenced bytes, two ways.
//!
//! - [`extent_usage`]: walks the subvolume's files with `FS_IOC_FIEMAP` and sums extent
//!   lengths, split by the kernel's `FIEMAP_EXTENT_SHARED` flag (what
//!   `btrfs filesystem du` does). Needs no quotas, costs nothing on the snapshot path;
//!   the cost is paid by the query, proportional to the number of extents.
//! - [`qgroup_usage`]: reads the level-0 quota group of the subvolume from the quota
//!   tree (`BTRFS_IOC_TREE_SEARCH`). Instant to read, but only exists when quotas are
//!   enabled, and quotas make every transaction commit (every snapshot) pay for
//!   accounting. See `docs/storage.md` for the measurements behind the default.

use std::fs::File;
use std::io;
use std::mem::size_of;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Result, StorageError};
use crate::ioctl;
use crate::subvol;

/// Space used by one subvolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubvolUsage {
    /// Bytes of data the subvolume references (its files' allocated extents).
    pub referenced_bytes: u64,
    /// Bytes referenced only by this subvolume: what deleting it would free.
    pub exclusive_bytes: u64,
}

impl SubvolUsage {
    /// Bytes shared with other subvolumes or files: referenced − exclusive.
    pub fn shared_bytes(&self) -> u64 {
        self.referenced_bytes.saturating_sub(self.exclusive_bytes)
    }
}

const FIEMAP_BATCH: usize = 512;

#[repr(C)]
struct FiemapBuf {
    hdr: ioctl::FiemapHeader,
    ext: [ioctl::FiemapExtent; FIEMAP_BATCH],
}

/// Exclusive / referenced data bytes of the subvolume at `path` by extent walk.
///
/// Files in nested subvolumes are not counted. Pages still dirty in memory (not yet
/// written back) are not counted; a read-only snapshot has none.
pub fn extent_usage(path: &Path) -> Result<SubvolUsage> {
    let mut usage = SubvolUsage::default();
    let mut buf = fiemap_buf();
    each_data_file(path, |_, p| {
        let f = match File::open(p) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(StorageError::io("open", p, e)),
        };
        file_extents(&f, &mut buf, &mut usage).map_err(|e| StorageError::io("fiemap", p, e))
    })?;
    Ok(usage)
}

fn fiemap_buf() -> Box<FiemapBuf> {
    Box::new(FiemapBuf {
        hdr: ioctl::FiemapHeader::default(),
        ext: [ioctl::FiemapExtent::default(); FIEMAP_BATCH],
    })
}

/// Calls `each(relative path, path)` for every regular file with allocated
/// blocks under `path`, skipping nested subvolumes and files that vanish
/// during the walk.
fn each_data_file(path: &Path, mut each: impl FnMut(&Path, &Path) -> Result<()>) -> Result<()> {
    let root_dev = std::fs::symlink_metadata(path)
        .map_err(|e| StorageError::io("stat", path, e))?
        .dev();
    let mut stack = vec![std::path::PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = path.join(&rel);
        let rd =
            std::fs::read_dir(&dir).map_err(|e| StorageError::io("read directory", &dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| StorageError::io("read directory", &dir, e))?;
            let r = rel.join(entry.file_name());
            let p = path.join(&r);
            let md = match std::fs::symlink_metadata(&p) {
                Ok(md) => md,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StorageError::io("stat", &p, e)),
            };
            if md.dev() != root_dev {
                continue; // a nested subvolume
            }
            if md.is_dir() {
                stack.push(r);
            } else if md.is_file() && md.blocks() > 0 {
                each(&r, &p)?;
            }
        }
    }
    Ok(())
}

fn file_extents(f: &File, buf: &mut FiemapBuf, usage: &mut SubvolUsage) -> io::Result<()> {
    walk_extents(f, buf, |e| {
        usage.referenced_bytes += e.fe_length;
        if e.fe_flags & ioctl::FIEMAP_EXTENT_SHARED == 0 {
            usage.exclusive_bytes += e.fe_length;
        }
    })
}

/// Calls `each` for every extent of `f`, in file order.
fn walk_extents(
    f: &File,
    buf: &mut FiemapBuf,
    mut each: impl FnMut(&ioctl::FiemapExtent),
) -> io::Result<()> {
    let mut start = 0u64;
    loop {
        buf.hdr = ioctl::FiemapHeader {
            fm_start: start,
            fm_length: u64::MAX - start,
            fm_extent_count: FIEMAP_BATCH as u32,
            ..Default::default()
        };
        // SAFETY: FS_IOC_FIEMAP takes a `struct fiemap` followed by `fm_extent_count`
        // `struct fiemap_extent`s; `FiemapBuf` is exactly that (repr(C), sizes tested).
        unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::FS_IOC_FIEMAP, buf) }?;
        let n = (buf.hdr.fm_mapped_extents as usize).min(FIEMAP_BATCH);
        if n == 0 {
            return Ok(());
        }
        for e in &buf.ext[..n] {
            each(e);
        }
        let last = buf.ext[n - 1];
        if last.fe_flags & ioctl::FIEMAP_EXTENT_LAST != 0 {
            return Ok(());
        }
        start = last.fe_logical + last.fe_length;
    }
}

/// One data extent of a file: `length` bytes at file offset `logical` are stored at
/// `physical` (the file system's address space; on btrfs, its logical addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileExtent {
    /// Offset in the file.
    pub logical: u64,
    /// Where the data is stored.
    pub physical: u64,
    /// Length in bytes.
    pub length: u64,
}

/// The allocated extents of the file at `path`, in file order (holes are absent).
///
/// With two read-only snapshots of the same file, [`rewritten_bytes`] of their maps
/// is what was written (copy-on-write) between them.
pub fn file_extent_map(path: &Path) -> Result<Vec<FileExtent>> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    let mut buf = Box::new(FiemapBuf {
        hdr: ioctl::FiemapHeader::default(),
        ext: [ioctl::FiemapExtent::default(); FIEMAP_BATCH],
    });
    let mut out = Vec::new();
    walk_extents(&f, &mut buf, |e| {
        out.push(FileExtent {
            logical: e.fe_logical,
            physical: e.fe_physical,
            length: e.fe_length,
        })
    })
    .map_err(|e| StorageError::io("fiemap", path, e))?;
    Ok(out)
}

/// Bytes of `cur` (an extent map in file order) not stored where `prev` stored the
/// same file offsets: on a copy-on-write file system, the data written since `prev`
/// was taken (new data in holes included). Both maps must be in file order.
pub fn rewritten_bytes(prev: &[FileExtent], cur: &[FileExtent]) -> u64 {
    let mut unchanged = 0u64;
    let mut total = 0u64;
    let mut j = 0usize;
    for c in cur {
        total += c.length;
        let (c0, c1) = (c.logical, c.logical.saturating_add(c.length));
        // Skip the extents of `prev` that end before this one starts.
        while j < prev.len() && prev[j].logical.saturating_add(prev[j].length) <= c0 {
            j += 1;
        }
        let mut k = j;
        while k < prev.len() && prev[k].logical < c1 {
            let p = &prev[k];
            let (p0, p1) = (p.logical, p.logical.saturating_add(p.length));
            // Same place iff the offset→address shift is the same over the overlap.
            let same =
                i128::from(p.physical) - i128::from(p0) == i128::from(c.physical) - i128::from(c0);
            if same {
                unchanged += c1.min(p1).saturating_sub(c0.max(p0));
            }
            k += 1;
        }
    }
    total.saturating_sub(unchanged)
}

/// Bytes of the subvolume (or directory) at `path` that are not stored where
/// `base` stores the same offsets of the same-named files: on a copy-on-write
/// file system, what was written since the two shared their data (a snapshot
/// against the snapshot it descends from). `base = None`, or a file `base` lacks:
/// every allocated byte counts. Files in nested subvolumes are not counted.
///
/// This is the charge of a snapshot in its lineage (see `docs/snapshots.md`):
/// an extent is counted by the first snapshot that holds it, never again by a
/// later one that still shares it. Cost: one FIEMAP walk of each file of both
/// trees (proportional to their extents); the result of two read-only
/// snapshots never changes, so callers cache it.
pub fn written_bytes(path: &Path, base: Option<&Path>) -> Result<u64> {
    let mut buf = fiemap_buf();
    let mut total = 0u64;
    each_data_file(path, |r, p| {
        let Some(cur) = extent_map_with(p, &mut buf)? else {
            return Ok(());
        };
        let prev = match base.map(|b| b.join(r)) {
            Some(bp) if bp.is_file() => extent_map_with(&bp, &mut buf)?.unwrap_or_default(),
            _ => Vec::new(),
        };
        total = total.saturating_add(rewritten_bytes(&prev, &cur));
        Ok(())
    })?;
    Ok(total)
}

/// The extent map of `p` (`None`: it vanished meanwhile).
fn extent_map_with(p: &Path, buf: &mut FiemapBuf) -> Result<Option<Vec<FileExtent>>> {
    let f = match File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StorageError::io("open", p, e)),
    };
    let mut out = Vec::new();
    walk_extents(&f, buf, |e| {
        out.push(FileExtent {
            logical: e.fe_logical,
            physical: e.fe_physical,
            length: e.fe_length,
        })
    })
    .map_err(|e| StorageError::io("fiemap", p, e))?;
    Ok(Some(out))
}

/// Quota status of a btrfs file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaStatus {
    /// Quotas are off.
    Disabled,
    /// Quotas are on and consistent.
    Enabled,
    /// Quotas are on but the numbers need a rescan.
    Inconsistent,
    /// Simple quotas (Linux 6.7+): every extent is charged to the subvolume
    /// that first wrote it, for as long as any subvolume holds it. A
    /// subvolume's exclusive number is then what it wrote, not what deleting
    /// it would free.
    Simple,
}

/// Turns btrfs *simple* quotas on for the file system holding `path`
/// (`BTRFS_IOC_QUOTA_CTL` with `BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA`; the
/// btrfs-progs of older hosts cannot do this). Needs Linux 6.7 or later:
/// older kernels answer `EINVAL`, reported as [`StorageError::Io`]. Extents
/// written before enabling are charged to nobody. No rescan: simple quotas
/// count from now on. strata never sets a qgroup *limit* on a live
/// subvolume: a limit turns the guest's RAM-file writeback into I/O errors.
pub fn enable_simple_quotas(path: &Path) -> Result<()> {
    let f = subvol::open_dir(path)?;
    let mut args = ioctl::QuotaCtlArgs {
        cmd: ioctl::QUOTA_CTL_ENABLE_SIMPLE_QUOTA,
        status: 0,
    };
    // SAFETY: BTRFS_IOC_QUOTA_CTL takes a `struct btrfs_ioctl_quota_ctl_args`.
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_QUOTA_CTL, &mut args) }
        .map_err(|e| StorageError::io("enable simple quotas", path, e))?;
    Ok(())
}

/// Whether this kernel has btrfs simple quotas (Linux 6.7 or later), from
/// `uname`'s release.
pub fn kernel_has_simple_quotas() -> bool {
    // SAFETY: `uname` fills the zeroed struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return false;
    }
    let rel: String = u
        .release
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8 as char)
        .collect();
    release_has_simple_quotas(&rel)
}

fn release_has_simple_quotas(release: &str) -> bool {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (major, minor) >= (6, 7)
}

/// Turns btrfs quota groups on or off for the file system holding `path`.
/// Enabling starts a rescan; this waits for it.
pub fn set_quotas(path: &Path, enable: bool) -> Result<()> {
    let f = subvol::open_dir(path)?;
    let mut args = ioctl::QuotaCtlArgs {
        cmd: if enable {
            ioctl::QUOTA_CTL_ENABLE
        } else {
            ioctl::QUOTA_CTL_DISABLE
        },
        status: 0,
    };
    // SAFETY: BTRFS_IOC_QUOTA_CTL takes a `struct btrfs_ioctl_quota_ctl_args`.
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_QUOTA_CTL, &mut args) }.map_err(|e| {
        StorageError::io(
            if enable {
                "enable quotas"
            } else {
                "disable quotas"
            },
            path,
            e,
        )
    })?;
    if enable {
        // SAFETY: BTRFS_IOC_QUOTA_RESCAN_WAIT takes no argument.
        match unsafe { ioctl::ioctl_val(f.as_fd(), ioctl::BTRFS_IOC_QUOTA_RESCAN_WAIT, 0) } {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {} // no rescan running
            Err(e) => return Err(StorageError::io("wait for quota rescan", path, e)),
        }
    }
    Ok(())
}

/// Whether quotas are on for the file system holding `path`.
pub fn quota_status(path: &Path) -> Result<QuotaStatus> {
    let key = ioctl::SearchKey {
        tree_id: ioctl::QUOTA_TREE_OBJECTID,
        max_objectid: 0,
        min_type: ioctl::QGROUP_STATUS_KEY,
        max_type: ioctl::QGROUP_STATUS_KEY,
        max_offset: u64::MAX,
        max_transid: u64::MAX,
        nr_items: 1,
        ..Default::default()
    };
    match search_one(path, key)? {
        None => Ok(QuotaStatus::Disabled),
        // struct btrfs_qgroup_status_item { version, generation, flags, rescan }
        Some(item) => match le_u64(&item, 16) {
            Some(flags) if flags & ioctl::QGROUP_STATUS_FLAG_INCONSISTENT != 0 => {
                Ok(QuotaStatus::Inconsistent)
            }
            Some(flags) if flags & ioctl::QGROUP_STATUS_FLAG_SIMPLE_MODE != 0 => {
                Ok(QuotaStatus::Simple)
            }
            _ => Ok(QuotaStatus::Enabled),
        },
    }
}

/// Exclusive / referenced bytes of subvolume `path` from its level-0 quota group.
///
/// Commits the current transaction first (`BTRFS_IOC_SYNC`) so the numbers include
/// recent writes. Fails with `QuotasDisabled` if quotas are off.
pub fn qgroup_usage(path: &Path) -> Result<SubvolUsage> {
    if !subvol::is_subvolume(path)? {
        return Err(StorageError::NotASubvolume {
            path: path.to_path_buf(),
        });
    }
    let id = subvol::subvolume_id(path)?;
    subvol::sync_fs(path)?;
    let key = ioctl::SearchKey {
        tree_id: ioctl::QUOTA_TREE_OBJECTID,
        min_type: ioctl::QGROUP_INFO_KEY,
        max_type: ioctl::QGROUP_INFO_KEY,
        min_offset: id,
        max_offset: id,
        max_transid: u64::MAX,
        nr_items: 1,
        ..Default::default()
    };
    let item = search_one(path, key)?.ok_or_else(|| StorageError::QuotasDisabled {
        root: path.to_path_buf(),
    })?;
    // struct btrfs_qgroup_info_item { generation, rfer, rfer_cmpr, excl, excl_cmpr }
    match (le_u64(&item, 8), le_u64(&item, 24)) {
        (Some(rfer), Some(excl)) => Ok(SubvolUsage {
            referenced_bytes: rfer,
            exclusive_bytes: excl,
        }),
        _ => Err(StorageError::Io {
            op: "read qgroup item",
            path: path.to_path_buf(),
            source: io::Error::new(io::ErrorKind::InvalidData, "qgroup info item too short"),
        }),
    }
}

/// The first item matching `key` in a tree search, if any.
fn search_one(path: &Path, key: ioctl::SearchKey) -> Result<Option<Vec<u8>>> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    let mut args = ioctl::SearchArgs::new(key);
    // SAFETY: BTRFS_IOC_TREE_SEARCH takes a `struct btrfs_ioctl_search_args`, which
    // `SearchArgs` reproduces (4096 bytes, tested).
    match unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_TREE_SEARCH, &mut *args) } {
        Ok(_) => {}
        // No quota tree at all: quotas were never enabled.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(StorageError::io("btrfs tree search", path, e)),
    }
    if args.key.nr_items == 0 {
        return Ok(None);
    }
    let h = size_of::<ioctl::SearchHeader>();
    let len = u32::from_ne_bytes(args.buf[28..32].try_into().unwrap_or([0; 4])) as usize;
    let ty = u32::from_ne_bytes(args.buf[24..28].try_into().unwrap_or([0; 4]));
    if ty != key.min_type || h + len > args.buf.len() {
        return Ok(None);
    }
    Ok(Some(args.buf[h..h + len].to_vec()))
}

fn le_u64(b: &[u8], off: usize) -> Option<u64> {
    b.get(off..off + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_is_referenced_minus_exclusive() {
        let u = SubvolUsage {
            referenced_bytes: 10,
            exclusive_bytes: 3,
        };
        assert_eq!(u.shared_bytes(), 7);
    }

    fn ext(logical: u64, physical: u64, length: u64) -> FileExtent {
        FileExtent {
            logical,
            physical,
            length,
        }
    }

    #[test]
    fn rewritten_bytes_counts_moved_and_new_ranges() {
        let prev = [ext(0, 1000, 100), ext(200, 5000, 100)];
        // Nothing changed, also when the same place is reported merged or split.
        assert_eq!(rewritten_bytes(&prev, &prev), 0);
        let split = [ext(0, 1000, 50), ext(50, 1050, 50), ext(200, 5000, 100)];
        assert_eq!(rewritten_bytes(&split, &prev), 0);
        assert_eq!(rewritten_bytes(&prev, &split), 0);
        // The middle of the first extent rewritten elsewhere, a hole filled, the
        // second extent untouched.
        let cur = [
            ext(0, 1000, 40),
            ext(40, 9000, 20),
            ext(60, 1060, 40),
            ext(100, 9020, 50),
            ext(200, 5000, 100),
        ];
        assert_eq!(rewritten_bytes(&prev, &cur), 70);
        // Everything new.
        assert_eq!(rewritten_bytes(&[], &cur), 250);
        // A range that overlaps two old extents at a shifted address is all new.
        assert_eq!(rewritten_bytes(&prev, &[ext(50, 1100, 200)]), 200);
        // Removed data does not count.
        assert_eq!(rewritten_bytes(&prev, &[]), 0);
    }

    #[test]
    fn extent_map_of_a_written_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data = vec![7u8; 1 << 20];
        std::fs::write(&p, &data).unwrap();
        File::open(&p).unwrap().sync_all().unwrap();
        match file_extent_map(&p) {
            Ok(map) => {
                let total: u64 = map.iter().map(|e| e.length).sum();
                assert!(total >= 1 << 20, "{map:?}");
                assert_eq!(rewritten_bytes(&map, &map), 0);
            }
            // tmpfs and friends have no FIEMAP.
            Err(StorageError::Io { source, .. })
                if source.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(file_extent_map(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn simple_quotas_from_linux_6_7() {
        assert!(release_has_simple_quotas("6.18.44-fc-v1045"));
        assert!(release_has_simple_quotas("6.7.0"));
        assert!(release_has_simple_quotas("7.0"));
        assert!(!release_has_simple_quotas("6.6.30-generic"));
        assert!(!release_has_simple_quotas("5.15.0"));
        assert!(!release_has_simple_quotas("garbage"));
    }

    #[test]
    fn le_u64_bounds() {
        let b = [1u8, 0, 0, 0, 0, 0, 0, 0, 2];
        assert_eq!(le_u64(&b, 0), Some(1));
        assert_eq!(le_u64(&b, 2), None);
    }
}
