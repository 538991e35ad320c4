//! Point-in-time reflink copies of a file that keeps changing, made in two
//! steps so that the second, short one is all a stopped guest waits for.
//!
//! 1. [`begin`], the guest running: the file's dirty pages written back, the
//!    pool's transaction committed (its id is the copy's *mark*), then a
//!    whole-file reflink (`FICLONE`) to the copy. Its cost follows the file's
//!    extents (thousands, once weeks of snapshots have fragmented a RAM file).
//! 2. [`catch_up`], the guest stopped: the pages dirtied since written back
//!    (`FIEMAP_FLAG_SYNC`: no log commit, no device flush), then only the
//!    file ranges whose extent items were written in a transaction after the
//!    mark are found (`BTRFS_IOC_TREE_SEARCH` with `min_transid`: btrfs skips
//!    every tree block older than that) and reflinked over the copy
//!    (`FICLONERANGE`). Its cost follows what changed in between.
//!
//! Why it is exact: every write that reaches a btrfs file inserts a file
//! extent item carrying the id of the transaction it is made in (copy on
//! write: the file's extents are shared with the copy, so none is written in
//! place), and every transaction after the mark's has a larger id. Parts of
//! older items that a write split keep their old data and their old id.
//!
//! Ranges **removed** from the file (a hole punched, `fallocate(PUNCH_HOLE)`,
//! as QEMU does when a guest discards) leave no item behind to find. They
//! are detected instead: after the catch-up the copy must reference exactly
//! as many bytes as the file (`st_blocks`, which btrfs keeps as the sum of
//! the file's extent items). A copy is equal to the file in every range a
//! changed item covers, and holds its begin-time data everywhere else, where
//! the file can only have kept that data or lost it; so the copy holds more
//! bytes exactly when the file lost some. Then the copy is reflinked whole
//! over ([`CatchUp::whole`]). A file whose size changed is refused.

use std::fs::File;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Result, StorageError};
use crate::ioctl;
use crate::subvol;

/// A copy made by [`begin`]: pass it to [`catch_up`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The first transaction whose writes the copy may lack.
    pub since: u64,
    /// The source's size when copied.
    pub len: u64,
}

/// What [`catch_up`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// File ranges reflinked over the copy (adjacent ones merged).
    pub ranges: usize,
    /// Bytes those ranges span.
    pub bytes: u64,
    /// Whether ranges were removed from the file since, so the copy was
    /// reflinked whole over instead.
    pub whole: bool,
}

/// Where [`write_back`]'s one-byte `FIEMAP` looks: far past any extent a
/// file of ours has (`s_maxbytes` is 2^63 - 1 on btrfs).
const FIEMAP_FAR: u64 = 1 << 62;

/// Writes back `f`'s dirty pages and waits until btrfs has recorded their
/// extents: a one-byte `FS_IOC_FIEMAP` with `FIEMAP_FLAG_SYNC` (the VFS
/// writes the whole mapping back and btrfs waits for the whole file's
/// ordered extents, whatever the range asked). Unlike `fdatasync` it
/// commits no log tree and flushes no device.
///
/// The byte asked for is far past the file's end ([`FIEMAP_FAR`]), where no
/// extent is: at offset 0 btrfs also reported that extent, and checking
/// whether it is shared walks its back references and joins the running
/// transaction, so a write-back in a snapshot's pause could wait for a
/// commit it did not need (docs/bench/soak.md, the stack samples of the
/// copies-into-the-snapshot run).
pub fn write_back(f: &File, path: &Path) -> Result<()> {
    let mut hdr = ioctl::FiemapHeader {
        fm_start: FIEMAP_FAR,
        fm_length: 1,
        fm_flags: ioctl::FIEMAP_FLAG_SYNC,
        fm_extent_count: 0,
        ..Default::default()
    };
    // SAFETY: FS_IOC_FIEMAP takes a `struct fiemap`; with `fm_extent_count`
    // 0 the kernel writes no `fiemap_extent` after the header (it only counts).
    unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::FS_IOC_FIEMAP, &mut hdr) }
        .map_err(|e| StorageError::io("write back (fiemap sync)", path, e))?;
    Ok(())
}

/// Opens `path` and writes its dirty pages back ([`write_back`]).
fn open_written_back(path: &Path) -> Result<File> {
    let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
    write_back(&f, path)?;
    Ok(f)
}

/// Step 1: writes `src` back, commits the pool's transaction, and reflinks
/// `src` to `dst` (which must not exist). `pool_root` is any path of the pool.
pub fn begin(pool_root: &Path, src: &Path, dst: &Path) -> Result<Mark> {
    let marks = begin_all(pool_root, &[(src, dst)])?;
    marks
        .into_iter()
        .next()
        .ok_or_else(|| StorageError::InvalidArgument {
            what: src.display().to_string(),
            reason: "no copy was begun".into(),
        })
}

/// [`begin`] for several files under one commit: each `(src, dst)` written
/// back, then the commit, then each reflinked. The marks in order.
pub fn begin_all(pool_root: &Path, files: &[(&Path, &Path)]) -> Result<Vec<Mark>> {
    let mut lens = Vec::with_capacity(files.len());
    for (src, _) in files {
        let f = open_written_back(src)?;
        lens.push(
            f.metadata()
                .map_err(|e| StorageError::io("stat", src, e))?
                .len(),
        );
    }
    let committed = subvol::commit_transaction(pool_root)?;
    let mut marks = Vec::with_capacity(files.len());
    for ((src, dst), len) in files.iter().zip(lens) {
        subvol::reflink_file(src, dst)?;
        marks.push(Mark {
            since: committed + 1,
            len,
        });
    }
    Ok(marks)
}

/// Step 1 with a snapshot for the copies: writes back each of `names` in
/// subvolume `src`, then snapshots `src` to `dst` (writable). The snapshot's
/// files are the copies, to catch up from `src`'s with the marks returned (in
/// the order of `names`); the snapshot's own commit is the mark (its
/// `otransid`: every extent item written in it or before is in the
/// snapshot, and a write after it lands in a later transaction).
///
/// Unlike [`begin_all`], no file is reflinked whole: the snapshot shares the
/// subvolume's tree, so this costs one commit whatever the files' extents,
/// and the catch-up's clones touch only the snapshot's leaves that changed.
pub fn begin_snapshot(src: &Path, dst: &Path, names: &[&str]) -> Result<Vec<Mark>> {
    for name in names {
        open_written_back(&src.join(name))?;
    }
    subvol::snapshot(src, dst, false)?;
    let made = crate::send::subvol_info(dst)?.otransid;
    if made == 0 {
        return Err(StorageError::InvalidArgument {
            what: dst.display().to_string(),
            reason: "the snapshot reports no creating transaction".into(),
        });
    }
    names
        .iter()
        .map(|name| {
            let copy = dst.join(name);
            let len = std::fs::metadata(&copy)
                .map_err(|e| StorageError::io("stat", &copy, e))?
                .len();
            Ok(Mark {
                since: made + 1,
                len,
            })
        })
        .collect()
}

/// Step 2: brings `dst`, made by [`begin`] with `mark`, up to `src` as it is
/// now: writes `src` back and reflinks over `dst` every range written since.
pub fn catch_up(src: &Path, dst: &Path, mark: Mark) -> Result<CatchUp> {
    let s = File::open(src).map_err(|e| StorageError::io("open", src, e))?;
    let md = s.metadata().map_err(|e| StorageError::io("stat", src, e))?;
    if md.len() != mark.len {
        return Err(StorageError::InvalidArgument {
            what: src.display().to_string(),
            reason: format!(
                "its size changed since the copy began ({} → {} bytes)",
                mark.len,
                md.len()
            ),
        });
    }
    let d = subvol::open_existing_for_clone(dst)?;
    write_back(&s, src)?;
    let tree = subvol::subvolume_id(src)?;
    let ranges = changed_ranges(&s, src, tree, md.ino(), mark.since)?;
    let mut done = CatchUp::default();
    for (off, len) in ranges {
        // The last block may run past the end of the file: clone to EOF.
        let len = len.min(md.len().saturating_sub(off));
        if len == 0 {
            continue;
        }
        let mut arg = ioctl::FileCloneRange {
            src_fd: s.as_raw_fd() as i64,
            src_offset: off,
            src_length: if off + len >= md.len() { 0 } else { len },
            dest_offset: off,
        };
        // SAFETY: FICLONERANGE takes a `struct file_clone_range` (layout tested);
        // `s` stays open for the call.
        unsafe { ioctl::ioctl_ptr(d.as_fd(), ioctl::FICLONERANGE, &mut arg) }
            .map_err(|e| StorageError::io("reflink range", dst, e))?;
        done.ranges += 1;
        done.bytes += len;
    }
    let referenced = |f: &File, p: &Path| -> Result<u64> {
        Ok(f.metadata()
            .map_err(|e| StorageError::io("stat", p, e))?
            .blocks())
    };
    if referenced(&d, dst)? != referenced(&s, src)? {
        // Ranges were removed from `src` since the copy began.
        subvol::ficlone(&s, &d, dst)?;
        done.whole = true;
    }
    Ok(done)
}

/// The byte ranges `[offset, len)` of inode `ino` in subvolume tree `tree`
/// whose file extent items were written in transaction `since` or later,
/// sorted and merged.
fn changed_ranges(
    f: &File,
    path: &Path,
    tree: u64,
    ino: u64,
    since: u64,
) -> Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut min_offset = 0u64;
    loop {
        let key = ioctl::SearchKey {
            tree_id: tree,
            min_objectid: ino,
            max_objectid: ino,
            min_type: ioctl::EXTENT_DATA_KEY,
            max_type: ioctl::EXTENT_DATA_KEY,
            min_offset,
            max_offset: u64::MAX,
            min_transid: since,
            max_transid: u64::MAX,
            nr_items: 4096,
            ..Default::default()
        };
        let mut args = ioctl::SearchArgs::new(key);
        // SAFETY: BTRFS_IOC_TREE_SEARCH takes a `struct btrfs_ioctl_search_args`,
        // which `SearchArgs` reproduces (4096 bytes, tested).
        unsafe { ioctl::ioctl_ptr(f.as_fd(), ioctl::BTRFS_IOC_TREE_SEARCH, &mut *args) }
            .map_err(|e| StorageError::io("btrfs tree search", path, e))?;
        let n = args.key.nr_items as usize;
        if n == 0 {
            break;
        }
        let mut at = 0usize;
        let mut last_offset = None;
        for _ in 0..n {
            let h = read_header(&args.buf, at).ok_or_else(|| bad(path, "search header"))?;
            let body = at + size_of::<ioctl::SearchHeader>();
            let item = args
                .buf
                .get(body..body + h.len as usize)
                .ok_or_else(|| bad(path, "search item"))?;
            at = body + h.len as usize;
            last_offset = Some(h.offset);
            if h.objectid != ino || h.ty != ioctl::EXTENT_DATA_KEY {
                continue;
            }
            if let Some(len) = changed_len(item, since) {
                push_merged(&mut out, h.offset, len);
            }
        }
        match last_offset.and_then(|o| o.checked_add(1)) {
            Some(next) => min_offset = next,
            None => break,
        }
    }
    Ok(out)
}

/// The length a file extent item covers if it was written in `since` or
/// later; `None` for an older one.
///
/// `struct btrfs_file_extent_item`: generation u64 @0, ram_bytes u64 @8,
/// compression u8 @16, encryption u8 @17, other_encoding u16 @18, type u8
/// @20; then for regular and preallocated extents disk_bytenr @21,
/// disk_num_bytes @29, offset @37, num_bytes @45 (53 bytes); an inline
/// extent's data follows type and covers ram_bytes.
fn changed_len(item: &[u8], since: u64) -> Option<u64> {
    let generation = le_u64(item, 0)?;
    if generation < since {
        return None;
    }
    const INLINE: u8 = 0;
    match *item.get(20)? {
        INLINE => le_u64(item, 8),
        _ => le_u64(item, 45),
    }
}

fn push_merged(out: &mut Vec<(u64, u64)>, off: u64, len: u64) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.0 + last.1 >= off {
            let end = (last.0 + last.1).max(off + len);
            last.1 = end - last.0;
            return;
        }
    }
    out.push((off, len));
}

fn read_header(buf: &[u8], at: usize) -> Option<ioctl::SearchHeader> {
    let b = buf.get(at..at + size_of::<ioctl::SearchHeader>())?;
    Some(ioctl::SearchHeader {
        transid: u64::from_ne_bytes(b[0..8].try_into().ok()?),
        objectid: u64::from_ne_bytes(b[8..16].try_into().ok()?),
        offset: u64::from_ne_bytes(b[16..24].try_into().ok()?),
        ty: u32::from_ne_bytes(b[24..28].try_into().ok()?),
        len: u32::from_ne_bytes(b[28..32].try_into().ok()?),
    })
}

fn le_u64(b: &[u8], off: usize) -> Option<u64> {
    b.get(off..off + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
}

fn bad(path: &Path, what: &str) -> StorageError {
    StorageError::io(
        "btrfs tree search",
        path,
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("truncated {what}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_and_overlapping_ranges_merge() {
        let mut v = Vec::new();
        push_merged(&mut v, 0, 4096);
        push_merged(&mut v, 4096, 4096);
        push_merged(&mut v, 6000, 100);
        push_merged(&mut v, 16384, 4096);
        push_merged(&mut v, 20480, 0);
        assert_eq!(v, vec![(0, 8192), (16384, 4096)]);
    }

    #[test]
    fn old_items_are_unchanged_and_new_ones_cover_their_bytes() {
        let mut item = vec![0u8; 53];
        item[0..8].copy_from_slice(&7u64.to_le_bytes());
        item[20] = 1; // regular
        item[45..53].copy_from_slice(&8192u64.to_le_bytes());
        assert_eq!(changed_len(&item, 8), None);
        assert_eq!(changed_len(&item, 7), Some(8192));
        assert_eq!(changed_len(&item[..30], 7), None, "truncated item");
    }
}
