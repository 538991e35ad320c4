//! Raw btrfs / VFS / loop ioctls: request numbers, argument structs (layouts of
//! `linux/btrfs.h`, `linux/fs.h`, `linux/fiemap.h`, `linux/loop.h`) and thin
//! wrappers that return `io::Result`. Nothing here knows about paths or the pool.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};

const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, type, nr, size)` of `asm-generic/ioctl.h` (x86_64, aarch64, riscv64).
const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (ty << 8) | nr
}

const BTRFS_MAGIC: u32 = 0x94;
/// `BTRFS_PATH_NAME_MAX`.
const PATH_NAME_MAX: usize = 4087;
/// `BTRFS_SUBVOL_NAME_MAX`.
const SUBVOL_NAME_MAX: usize = 4039;
/// `BTRFS_INO_LOOKUP_PATH_MAX`.
const INO_LOOKUP_PATH_MAX: usize = 4080;
/// `BTRFS_SEARCH_ARGS_BUFSIZE`.
const SEARCH_ARGS_BUFSIZE: usize = 4096 - size_of::<SearchKey>();

/// `BTRFS_SUPER_MAGIC` (statfs `f_type`).
pub const BTRFS_SUPER_MAGIC: i64 = 0x9123_683E;
/// `BTRFS_SUBVOL_RDONLY`.
pub const SUBVOL_RDONLY: u64 = 1 << 1;
/// `BTRFS_FIRST_FREE_OBJECTID`: the inode number of every subvolume's root directory.
pub const FIRST_FREE_OBJECTID: u64 = 256;
/// `BTRFS_QUOTA_TREE_OBJECTID`.
pub const QUOTA_TREE_OBJECTID: u64 = 8;
/// `BTRFS_QGROUP_STATUS_KEY`.
pub const QGROUP_STATUS_KEY: u32 = 240;
/// `BTRFS_QGROUP_INFO_KEY`.
pub const QGROUP_INFO_KEY: u32 = 242;
/// `BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT`.
pub const QGROUP_STATUS_FLAG_INCONSISTENT: u64 = 1 << 2;
/// `BTRFS_QUOTA_CTL_ENABLE`.
pub const QUOTA_CTL_ENABLE: u64 = 1;
/// `BTRFS_QUOTA_CTL_DISABLE`.
pub const QUOTA_CTL_DISABLE: u64 = 2;
/// `BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA` (Linux 6.7): simple quotas, each extent
/// charged to the subvolume that first wrote it, for as long as it exists.
pub const QUOTA_CTL_ENABLE_SIMPLE_QUOTA: u64 = 4;
/// `BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE`: the quota tree is in simple mode.
pub const QGROUP_STATUS_FLAG_SIMPLE_MODE: u64 = 1 << 3;

/// `struct btrfs_ioctl_vol_args`.
#[repr(C)]
pub struct VolArgs {
    pub fd: i64,
    pub name: [u8; PATH_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_vol_args_v2` (the union of `size`/`qgroup_inherit` is `unused`).
#[repr(C)]
pub struct VolArgsV2 {
    pub fd: i64,
    pub transid: u64,
    pub flags: u64,
    pub unused: [u64; 4],
    pub name: [u8; SUBVOL_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
pub struct InoLookupArgs {
    pub treeid: u64,
    pub objectid: u64,
    pub name: [u8; INO_LOOKUP_PATH_MAX],
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
pub struct QuotaCtlArgs {
    pub cmd: u64,
    pub status: u64,
}

/// `struct btrfs_ioctl_search_key`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct SearchKey {
    pub tree_id: u64,
    pub min_objectid: u64,
    pub max_objectid: u64,
    pub min_offset: u64,
    pub max_offset: u64,
    pub min_transid: u64,
    pub max_transid: u64,
    pub min_type: u32,
    pub max_type: u32,
    pub nr_items: u32,
    pub unused: u32,
    pub unused1: u64,
    pub unused2: u64,
    pub unused3: u64,
    pub unused4: u64,
}

/// `struct btrfs_ioctl_search_args`.
#[repr(C)]
pub struct SearchArgs {
    pub key: SearchKey,
    pub buf: [u8; SEARCH_ARGS_BUFSIZE],
}

/// `struct btrfs_ioctl_search_header` (read unaligned out of `SearchArgs::buf`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SearchHeader {
    pub transid: u64,
    pub objectid: u64,
    pub offset: u64,
    pub ty: u32,
    pub len: u32,
}

/// `struct fiemap` without its flexible array.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct FiemapHeader {
    pub fm_start: u64,
    pub fm_length: u64,
    pub fm_flags: u32,
    pub fm_mapped_extents: u32,
    pub fm_extent_count: u32,
    pub fm_reserved: u32,
}

/// `struct fiemap_extent`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct FiemapExtent {
    pub fe_logical: u64,
    pub fe_physical: u64,
    pub fe_length: u64,
    pub fe_reserved64: [u64; 2],
    pub fe_flags: u32,
    pub fe_reserved: [u32; 3],
}

/// `FIEMAP_EXTENT_LAST`.
pub const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// `FIEMAP_EXTENT_SHARED`.
pub const FIEMAP_EXTENT_SHARED: u32 = 0x2000;

/// `FIEMAP_FLAG_SYNC`: write the file's dirty data back (and, on btrfs,
/// wait until its extents are recorded) before mapping.
pub const FIEMAP_FLAG_SYNC: u32 = 0x1;

/// `struct file_clone_range` (`linux/fs.h`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct FileCloneRange {
    pub src_fd: i64,
    pub src_offset: u64,
    pub src_length: u64,
    pub dest_offset: u64,
}

/// `BTRFS_EXTENT_DATA_KEY`: a file extent item (key: inode, type, file offset).
pub const EXTENT_DATA_KEY: u32 = 108;

pub const BTRFS_IOC_SYNC: u32 = ioc(IOC_NONE, BTRFS_MAGIC, 8, 0);
pub const FICLONERANGE: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 13, size_of::<FileCloneRange>());
pub const BTRFS_IOC_RESIZE: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 3, size_of::<VolArgs>());
pub const FICLONE: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 9, size_of::<libc::c_int>());
pub const BTRFS_IOC_SUBVOL_CREATE: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 14, size_of::<VolArgs>());
pub const BTRFS_IOC_SNAP_DESTROY: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 15, size_of::<VolArgs>());
pub const BTRFS_IOC_TREE_SEARCH: u32 = ioc(
    IOC_READ | IOC_WRITE,
    BTRFS_MAGIC,
    17,
    size_of::<SearchArgs>(),
);
pub const BTRFS_IOC_INO_LOOKUP: u32 = ioc(
    IOC_READ | IOC_WRITE,
    BTRFS_MAGIC,
    18,
    size_of::<InoLookupArgs>(),
);
pub const BTRFS_IOC_SNAP_CREATE_V2: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 23, size_of::<VolArgsV2>());
pub const BTRFS_IOC_SUBVOL_GETFLAGS: u32 = ioc(IOC_READ, BTRFS_MAGIC, 25, size_of::<u64>());
pub const BTRFS_IOC_SUBVOL_SETFLAGS: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 26, size_of::<u64>());
pub const BTRFS_IOC_QUOTA_CTL: u32 = ioc(
    IOC_READ | IOC_WRITE,
    BTRFS_MAGIC,
    40,
    size_of::<QuotaCtlArgs>(),
);
pub const BTRFS_IOC_QUOTA_RESCAN_WAIT: u32 = ioc(IOC_NONE, BTRFS_MAGIC, 46, 0);
/// Starts committing the running transaction, without writing back any
/// file's dirty data first; writes its id (`u64`) to the argument.
pub const BTRFS_IOC_START_SYNC: u32 = ioc(IOC_READ, BTRFS_MAGIC, 24, size_of::<u64>());
/// Waits until the transaction whose id (`u64`) the argument points to is committed.
pub const BTRFS_IOC_WAIT_SYNC: u32 = ioc(IOC_WRITE, BTRFS_MAGIC, 22, size_of::<u64>());
pub const FS_IOC_FIEMAP: u32 = ioc(
    IOC_READ | IOC_WRITE,
    b'f' as u32,
    11,
    size_of::<FiemapHeader>(),
);
/// `LOOP_SET_CAPACITY` (`linux/loop.h`, not an `_IOC` number).
pub const LOOP_SET_CAPACITY: u32 = 0x4C07;
/// `LOOP_CLR_FD`.
pub const LOOP_CLR_FD: u32 = 0x4C01;

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `ioctl(fd, request, arg)` where `arg` points to a `T` the kernel reads and/or writes.
///
/// # Safety
/// `request` must be an ioctl whose argument is a pointer to a `T` with exactly the
/// layout the kernel expects for it on `fd`'s file type.
pub unsafe fn ioctl_ptr<T>(
    fd: BorrowedFd<'_>,
    request: u32,
    arg: &mut T,
) -> io::Result<libc::c_int> {
    // SAFETY: the caller guarantees `T` is the kernel's argument type for `request`;
    // `arg` is a valid, exclusive, live pointer for the whole call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) })
}

/// `ioctl(fd, request, value)` for ioctls whose argument is an integer passed by value.
///
/// # Safety
/// `request` must be an ioctl that takes its argument by value (no pointer).
pub unsafe fn ioctl_val(
    fd: BorrowedFd<'_>,
    request: u32,
    value: libc::c_ulong,
) -> io::Result<libc::c_int> {
    // SAFETY: the caller guarantees the kernel does not dereference `value`.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), request as _, value) })
}

/// Copies `name` into a NUL-terminated fixed buffer; `None` if it does not fit or has a NUL.
pub fn fill_name(buf: &mut [u8], name: &[u8]) -> Option<()> {
    if name.len() >= buf.len() || name.contains(&0) {
        return None;
    }
    buf[..name.len()].copy_from_slice(name);
    buf[name.len()] = 0;
    Some(())
}

impl VolArgs {
    /// Zeroed arguments.
    pub fn zeroed() -> Box<Self> {
        Box::new(VolArgs {
            fd: 0,
            name: [0; PATH_NAME_MAX + 1],
        })
    }
}

impl VolArgsV2 {
    /// Zeroed arguments.
    pub fn zeroed() -> Box<Self> {
        Box::new(VolArgsV2 {
            fd: 0,
            transid: 0,
            flags: 0,
            unused: [0; 4],
            name: [0; SUBVOL_NAME_MAX + 1],
        })
    }
}

impl InoLookupArgs {
    /// Zeroed arguments.
    pub fn zeroed() -> Box<Self> {
        Box::new(InoLookupArgs {
            treeid: 0,
            objectid: 0,
            name: [0; INO_LOOKUP_PATH_MAX],
        })
    }
}

impl SearchArgs {
    /// Arguments with the given key and an empty buffer.
    pub fn new(key: SearchKey) -> Box<Self> {
        Box::new(SearchArgs {
            key,
            buf: [0; SEARCH_ARGS_BUFSIZE],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values printed by a C program including the kernel UAPI headers on x86_64.
    #[test]
    fn request_numbers_match_kernel_headers() {
        assert_eq!(BTRFS_IOC_SUBVOL_CREATE, 0x5000_940e);
        assert_eq!(BTRFS_IOC_SNAP_CREATE_V2, 0x5000_9417);
        assert_eq!(BTRFS_IOC_SNAP_DESTROY, 0x5000_940f);
        assert_eq!(BTRFS_IOC_SUBVOL_GETFLAGS, 0x8008_9419);
        assert_eq!(BTRFS_IOC_SUBVOL_SETFLAGS, 0x4008_941a);
        assert_eq!(FICLONE, 0x4004_9409);
        assert_eq!(FICLONERANGE, 0x4020_940d);
        assert_eq!(BTRFS_IOC_INO_LOOKUP, 0xd000_9412);
        assert_eq!(BTRFS_IOC_TREE_SEARCH, 0xd000_9411);
        assert_eq!(BTRFS_IOC_QUOTA_CTL, 0xc010_9428);
        assert_eq!(BTRFS_IOC_QUOTA_RESCAN_WAIT, 0x942e);
        assert_eq!(BTRFS_IOC_SYNC, 0x9408);
        assert_eq!(BTRFS_IOC_START_SYNC, 0x8008_9418);
        assert_eq!(BTRFS_IOC_WAIT_SYNC, 0x4008_9416);
        assert_eq!(BTRFS_IOC_RESIZE, 0x5000_9403);
        assert_eq!(FS_IOC_FIEMAP, 0xc020_660b);
    }

    #[test]
    fn struct_sizes_match_kernel_headers() {
        assert_eq!(size_of::<VolArgs>(), 4096);
        assert_eq!(size_of::<VolArgsV2>(), 4096);
        assert_eq!(size_of::<InoLookupArgs>(), 4096);
        assert_eq!(size_of::<SearchArgs>(), 4096);
        assert_eq!(size_of::<SearchKey>(), 104);
        assert_eq!(size_of::<SearchHeader>(), 32);
        assert_eq!(size_of::<FiemapHeader>(), 32);
        assert_eq!(size_of::<FiemapExtent>(), 56);
        assert_eq!(size_of::<FileCloneRange>(), 32);
    }

    #[test]
    fn fill_name_rejects_too_long_and_nul() {
        let mut b = [0xffu8; 8];
        assert!(fill_name(&mut b, b"abc").is_some());
        assert_eq!(&b[..4], b"abc\0");
        assert!(fill_name(&mut b, b"12345678").is_none());
        assert!(fill_name(&mut b, b"a\0b").is_none());
    }
}
