//! Integration tests on real btrfs file systems in loop-mounted images (needs root).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use strata_storage::testing::TestPool;
use strata_storage::{
    subvol, Pool, PoolConfig, PoolOptions, QuotaStatus, StorageError, UsageMethod,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Writes `mib` MiB of non-zero, non-repeating data (so no hole or dedup games) and fsyncs.
fn write_file(path: &Path, mib: u64) {
    let mut f = File::create(path).expect("create");
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..mib {
        for (j, chunk) in buf.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&(i * MIB + j as u64 * 8 + 1).to_le_bytes());
        }
        f.write_all(&buf).expect("write");
    }
    f.sync_all().expect("fsync");
}

/// Creates `path` with `len` bytes and maps it shared and writable, as QEMU
/// maps its RAM file. The caller unmaps `(ptr, len)` when done.
fn map_new_file(path: &Path, len: usize) -> (File, *mut libc::c_void) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .expect("create the mapped file");
    f.set_len(len as u64).expect("size");
    // SAFETY: mapping a file we own of `len` bytes; the caller uses the
    // pointer only within `len` and unmaps it.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    (f, ptr)
}

fn is_mounted(mp: &Path) -> bool {
    let mi = fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let mp = mp.to_str().expect("utf8");
    mi.lines().any(|l| l.split(' ').nth(4) == Some(mp))
}

#[test]
fn image_mode_creates_mounts_reuses_and_remounts() {
    let dir = tempfile::Builder::new()
        .prefix("strata-storage-test-")
        .tempdir_in("/tmp")
        .expect("tmp");
    let cfg = TestPool::config_in(dir.path(), GIB);
    let pool = Pool::open(&cfg).expect("create pool");
    let root = pool.root().to_path_buf();
    assert!(is_mounted(&root));
    assert_eq!(subvol::fs_type(&root).expect("statfs").1, "btrfs");
    for d in strata_storage::LAYOUT {
        assert!(root.join(d).is_dir(), "{d}");
    }
    let image = dir.path().join("pool.img");
    let md = fs::metadata(&image).expect("image");
    assert_eq!(md.len(), GIB);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&md) * 512 < 64 * MIB,
        "image is sparse"
    );
    pool.create_subvolume("sandboxes/a").expect("subvol");

    // Already mounted: reused, not mounted twice.
    let again = Pool::open(&cfg).expect("reuse mounted pool");
    assert_eq!(again.root(), root);
    let mounts = fs::read_to_string("/proc/self/mountinfo").expect("mi");
    assert_eq!(
        mounts
            .lines()
            .filter(|l| l.split(' ').nth(4) == root.to_str())
            .count(),
        1
    );
    drop(again);

    // Unmount, then reopen: the image is reused with its contents.
    pool.unmount().expect("unmount");
    assert!(!is_mounted(&root));
    let pool = Pool::open(&cfg).expect("remount");
    assert!(pool.is_subvolume("sandboxes/a").expect("stat"));
    pool.unmount().expect("unmount");
    let loops = fs::read_dir("/sys/block")
        .expect("sys")
        .flatten()
        .filter(|e| {
            fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|b| b.trim() == image.to_str().unwrap_or(""))
        });
    assert_eq!(loops.count(), 0, "loop device detached");
}

#[test]
fn image_mode_refuses_a_mount_point_with_something_else_mounted() {
    let dir = tempfile::Builder::new()
        .prefix("strata-storage-test-")
        .tempdir_in("/tmp")
        .expect("tmp");
    let mp = dir.path().join("mnt");
    fs::create_dir(&mp).expect("mkdir");
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "strata-test-tmpfs"])
        .arg(&mp)
        .status();
    assert!(st.expect("mount").success());
    let res = Pool::open(&TestPool::config_in(dir.path(), GIB));
    let c = std::ffi::CString::new(mp.to_str().expect("utf8")).expect("cstr");
    // SAFETY: `c` is a valid NUL-terminated path; we unmount the tmpfs we mounted above.
    assert_eq!(unsafe { libc::umount2(c.as_ptr(), 0) }, 0);
    match res {
        Err(e @ StorageError::MountPointBusy { .. }) => {
            assert!(e.to_string().contains("tmpfs"), "{e}")
        }
        other => panic!("expected MountPointBusy, got {other:?}"),
    }
}

#[test]
fn path_mode_refuses_non_btrfs_and_accepts_btrfs() {
    let dir = tempfile::Builder::new()
        .prefix("strata-storage-test-")
        .tempdir_in("/tmp")
        .expect("tmp");
    match Pool::open(&PoolConfig::Path(dir.path().into())) {
        Err(e @ StorageError::NotBtrfs { .. }) => {
            assert!(e.to_string().contains("not btrfs"), "{e}")
        }
        other => panic!("expected NotBtrfs, got {other:?}"),
    }
    let tp = TestPool::new(GIB).expect("pool");
    let sub = tp.root().join("sandboxes");
    let p = Pool::open(&PoolConfig::Path(sub.clone())).expect("path pool on btrfs");
    assert_eq!(p.root(), sub);
    assert!(p.image().is_none());
    p.create_subvolume("x").expect("subvol in path pool");
    assert!(p.is_subvolume("x").expect("stat"));
    // Closing a path pool unmounts nothing.
    p.unmount().expect("close");
    assert!(is_mounted(tp.root()));
}

#[test]
fn subvolume_create_snapshot_readonly_delete() {
    let tp = TestPool::new(GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/sb").expect("create");
    assert!(tp.is_subvolume(&sb).expect("stat"));
    assert!(!tp.is_readonly(&sb).expect("flags"));
    fs::write(sb.join("meta.json"), b"{\"v\":1}").expect("write");
    assert!(!tp.is_subvolume("sandboxes").expect("stat"), "plain dir");

    // Read-only snapshot: content is there, writes fail with EROFS.
    let ro = tp
        .snapshot(&sb, "snapshots/sb@1", true)
        .expect("ro snapshot");
    assert!(tp.is_subvolume(&ro).expect("stat") && tp.is_readonly(&ro).expect("flags"));
    assert_eq!(fs::read(ro.join("meta.json")).expect("read"), b"{\"v\":1}");
    let e = fs::write(ro.join("new"), b"x").expect_err("write into ro snapshot");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    let e = OpenOptions::new()
        .write(true)
        .open(ro.join("meta.json"))
        .expect_err("open ro file for write");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));

    // Writable snapshot of the read-only one (a fork) is independent.
    let rw = tp
        .snapshot(&ro, "sandboxes/fork", false)
        .expect("rw snapshot");
    assert!(!tp.is_readonly(&rw).expect("flags"));
    fs::write(rw.join("meta.json"), b"fork").expect("write fork");
    assert_eq!(fs::read(sb.join("meta.json")).expect("read"), b"{\"v\":1}");
    assert_eq!(fs::read(ro.join("meta.json")).expect("read"), b"{\"v\":1}");

    // Flags toggle.
    tp.set_readonly(&rw, true).expect("set ro");
    assert!(fs::write(rw.join("x"), b"x").is_err());
    tp.set_readonly(&rw, false).expect("set rw");
    fs::write(rw.join("x"), b"x").expect("writable again");

    // Errors leave things as they were.
    assert!(matches!(
        tp.snapshot(&sb, &ro, true),
        Err(StorageError::AlreadyExists { .. })
    ));
    assert_eq!(fs::read(ro.join("meta.json")).expect("read"), b"{\"v\":1}");
    assert!(matches!(
        tp.create_subvolume(&sb),
        Err(StorageError::AlreadyExists { .. })
    ));
    assert!(matches!(
        tp.snapshot("sandboxes/none", "snapshots/n", true),
        Err(StorageError::NotFound { .. })
    ));
    assert!(!tp.root().join("snapshots/n").exists());
    assert!(matches!(
        tp.snapshot("sandboxes", "snapshots/d", true),
        Err(StorageError::NotASubvolume { .. })
    ));
    assert!(matches!(
        tp.delete_subvolume("sandboxes"),
        Err(StorageError::NotASubvolume { .. })
    ));
    assert!(matches!(
        tp.create_subvolume("/tmp/outside"),
        Err(StorageError::OutsidePool { .. })
    ));
    assert!(matches!(
        tp.create_subvolume("sandboxes/../../escape"),
        Err(StorageError::OutsidePool { .. })
    ));
    assert!(matches!(
        tp.create_subvolume("sandboxes/.."),
        Err(StorageError::InvalidArgument { .. })
    ));
    assert!(matches!(
        tp.snapshot(&sb, "nodir/x", true),
        Err(StorageError::NotFound { .. })
    ));

    // Delete, read-only or not.
    tp.delete_subvolume(&ro).expect("delete ro");
    tp.delete_subvolume(&rw).expect("delete rw");
    assert!(!ro.exists() && !rw.exists());
    assert!(matches!(
        tp.delete_subvolume(&ro),
        Err(StorageError::NotFound { .. })
    ));
    assert!(sb.join("meta.json").exists());
}

#[test]
fn trash_is_immediate_and_deletes_in_background() {
    let tp = TestPool::new(GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/t").expect("create");
    write_file(&sb.join("mem"), 32);
    let ro = tp.snapshot(&sb, "snapshots/t@1", true).expect("snap");
    fs::create_dir(tp.root().join("sandboxes/plain")).expect("mkdir");
    tp.trash(&ro).expect("trash ro snapshot");
    tp.trash(&sb).expect("trash subvolume");
    tp.trash("sandboxes/plain").expect("trash plain dir");
    assert!(!sb.exists() && !ro.exists());
    tp.wait_trash_empty();
    assert_eq!(fs::read_dir(tp.trash_dir()).expect("ls").count(), 0);
    assert!(matches!(
        tp.trash("sandboxes/t"),
        Err(StorageError::NotFound { .. })
    ));
}

#[test]
fn reflinked_file_shares_extents() {
    let tp = TestPool::with_options(GIB, PoolOptions { quotas: true }).expect("pool");
    assert_eq!(tp.quota_status().expect("status"), QuotaStatus::Enabled);
    let a = tp.create_subvolume("sandboxes/a").expect("a");
    let b = tp.create_subvolume("sandboxes/b").expect("b");
    write_file(&a.join("disk.img"), 64);
    tp.reflink_file(a.join("disk.img"), b.join("disk.img"))
        .expect("reflink");
    let mut x = Vec::new();
    File::open(b.join("disk.img"))
        .expect("open")
        .read_to_end(&mut x)
        .expect("read");
    assert_eq!(x.len() as u64, 64 * MIB);
    assert_eq!(fs::read(a.join("disk.img")).expect("read"), x);
    subvol::sync_fs(tp.root()).expect("sync");
    for m in [UsageMethod::Extents, UsageMethod::Qgroups] {
        let u = tp.subvolume_usage(&b, m).expect("usage");
        assert!(u.referenced_bytes >= 64 * MIB, "{m:?} {u:?}");
        assert!(
            u.exclusive_bytes < MIB,
            "{m:?}: 2nd reflink should be ~0 exclusive: {u:?}"
        );
        assert!(u.shared_bytes() >= 63 * MIB, "{m:?} {u:?}");
    }
    // The clone is a copy: writing it does not touch the original.
    let mut f = OpenOptions::new()
        .write(true)
        .open(b.join("disk.img"))
        .expect("open");
    f.write_all(b"changed").expect("write");
    f.sync_all().expect("fsync");
    assert_eq!(&fs::read(a.join("disk.img")).expect("read")[..7], &x[..7]);
    // Reflink onto an existing file is refused and leaves it alone.
    assert!(matches!(
        tp.reflink_file(a.join("disk.img"), b.join("disk.img")),
        Err(StorageError::AlreadyExists { .. })
    ));
    assert_eq!(
        &fs::read(b.join("disk.img")).expect("read")[..7],
        b"changed"
    );
    // Reflinked over an existing file: it keeps its inode and takes the
    // source's bytes (what a pause by copies does to a snapshot's files).
    let ino = fs::metadata(b.join("disk.img")).expect("stat").ino();
    tp.reflink_over(a.join("disk.img"), b.join("disk.img"))
        .expect("reflink over");
    assert_eq!(fs::metadata(b.join("disk.img")).expect("stat").ino(), ino);
    assert_eq!(
        fs::read(b.join("disk.img")).expect("read"),
        fs::read(a.join("disk.img")).expect("read")
    );
}

#[test]
fn a_read_only_subvolume_is_trashed_without_clearing_its_flag() {
    let tp = TestPool::new(GIB).expect("pool");
    let a = tp.create_subvolume("sandboxes/a").expect("a");
    write_file(&a.join("mem"), 8);
    let s = tp
        .snapshot(&a, tp.snapshots_dir().join("s"), true)
        .expect("snapshot");
    let before = subvol::commit_transaction(tp.root()).expect("commit");
    tp.trash(&s).expect("trash");
    assert!(!s.exists(), "gone from its place at once");
    // Clearing the read-only flag would have committed a transaction.
    let after = subvol::commit_transaction(tp.root()).expect("commit");
    assert_eq!(after, before + 1, "the trash committed in between");
    tp.wait_trash_empty();
    assert_eq!(fs::read_dir(tp.trash_dir()).expect("ls").count(), 0);
}

#[test]
fn ten_writable_snapshots_share_a_256mib_file() {
    let tp = TestPool::new(2 * GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/big").expect("create");
    write_file(&sb.join("mem"), 256);
    subvol::sync_fs(tp.root()).expect("sync");
    let before = tp.usage().expect("usage").used_bytes;
    for i in 0..10 {
        let s = tp
            .snapshot(&sb, format!("sandboxes/fork{i}"), false)
            .expect("snapshot");
        let mut f = OpenOptions::new()
            .write(true)
            .open(s.join("mem"))
            .expect("open");
        f.seek(SeekFrom::Start(i * 8 * MIB)).expect("seek");
        f.write_all(&[0xab; 4096]).expect("write");
        f.sync_all().expect("fsync");
    }
    subvol::sync_fs(tp.root()).expect("sync");
    let after = tp.usage().expect("usage").used_bytes;
    let grown = after.saturating_sub(before);
    println!(
        "10 writable snapshots of 256 MiB: pool used +{} KiB",
        grown >> 10
    );
    assert!(
        grown < 32 * MIB,
        "10 snapshots used {grown} bytes, expected << 2560 MiB"
    );
    let u = tp
        .subvolume_usage("sandboxes/fork3", UsageMethod::Extents)
        .expect("usage");
    assert!(
        u.referenced_bytes >= 256 * MIB && u.exclusive_bytes < MIB,
        "{u:?}"
    );
}

/// QEMU's RAM file: mapped MAP_SHARED, written through the mapping, never msync'ed.
#[test]
fn snapshot_captures_pages_dirtied_through_a_shared_mapping() {
    let tp = TestPool::new(GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/vm").expect("create");
    let len = 64 * MIB as usize;
    let (_file, ptr) = map_new_file(&sb.join("mem"), len);
    // SAFETY: `ptr` is a live, writable mapping of `len` bytes.
    let mem = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    let pages = [0usize, 1, 777, 4096, len / 4096 - 1];
    let check = |snap: &Path, tag: u8| {
        let data = fs::read(snap.join("mem")).expect("read snapshot mem");
        for p in pages {
            assert_eq!(data[p * 4096], tag, "page {p} in {}", snap.display());
            assert_eq!(data[p * 4096 + 4095], tag.wrapping_add(1), "page {p} end");
        }
    };
    for (round, tag) in [(1u8, 0x5au8), (2, 0xc3)] {
        for p in pages {
            mem[p * 4096] = tag;
            mem[p * 4096 + 4095] = tag.wrapping_add(1);
        }
        let snap = tp
            .snapshot(&sb, format!("snapshots/vm@{round}"), true)
            .expect("snapshot");
        check(&snap, tag);
    }
    check(&tp.root().join("snapshots/vm@1"), 0x5a);
    // SAFETY: unmapping the mapping created above; `mem` is not used afterwards.
    assert_eq!(unsafe { libc::munmap(ptr, len) }, 0);
}

#[test]
fn full_pool_maps_to_no_space_and_leaves_no_partial_subvolume() {
    let tp = TestPool::new(strata_storage::MIN_IMAGE_SIZE).expect("pool");
    let sb = tp.create_subvolume("sandboxes/s").expect("create");
    // Fill data...
    let mut f = File::create(sb.join("fill")).expect("create");
    let buf = vec![0x11u8; MIB as usize];
    while f.write_all(&buf).is_ok() {}
    drop(f);
    // ...then metadata (inodes with big xattrs live in metadata blocks).
    let val = vec![b'x'; 3900];
    for i in 0..100_000 {
        let p = sb.join(format!("x{i}"));
        if File::create(&p).is_err() {
            break;
        }
        let c = std::ffi::CString::new(p.to_str().expect("utf8")).expect("cstr");
        // SAFETY: valid NUL-terminated path and name; `val` is a live buffer of its length.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"user.fill".as_ptr(),
                val.as_ptr().cast(),
                val.len(),
                0,
            )
        };
        if r != 0 {
            break;
        }
    }
    // Snapshots until the pool is full.
    let mut err = None;
    let mut made = 0;
    for i in 0..5000 {
        match tp.snapshot(&sb, format!("snapshots/s{i}"), true) {
            Ok(_) => made += 1,
            Err(e) => {
                err = Some((i, e));
                break;
            }
        }
    }
    let (i, e) = err.expect("the pool never filled up");
    assert!(e.is_no_space(), "{e:?}");
    assert_eq!(
        e.to_string().split(" (").next(),
        Some("storage pool is full")
    );
    assert!(
        !tp.root().join(format!("snapshots/s{i}")).exists(),
        "no partial snapshot"
    );
    assert_eq!(fs::read_dir(tp.snapshots_dir()).expect("ls").count(), made);
    // Freeing space makes it work again.
    fs::remove_file(sb.join("fill")).expect("rm");
    for j in 0..made {
        tp.delete_subvolume(format!("snapshots/s{j}"))
            .expect("delete");
    }
    subvol::sync_fs(tp.root()).expect("sync");
    let mut ok = false;
    for _ in 0..50 {
        if tp.snapshot(&sb, "snapshots/after", true).is_ok() {
            ok = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let _ = subvol::sync_fs(tp.root());
    }
    assert!(ok, "snapshot works again after freeing space");
}

#[test]
fn grow_enlarges_the_file_system_online() {
    let tp = TestPool::new(256 * MIB).expect("pool");
    let before = tp.usage().expect("usage");
    assert_eq!(before.image_size_bytes, Some(256 * MIB));
    tp.grow(768 * MIB).expect("grow");
    let after = tp.usage().expect("usage");
    assert_eq!(after.image_size_bytes, Some(768 * MIB));
    assert!(
        after.total_bytes >= before.total_bytes + 500 * MIB,
        "{before:?} -> {after:?}"
    );
    assert!(
        after.free_bytes > before.free_bytes + 400 * MIB,
        "{before:?} -> {after:?}"
    );
    assert!(matches!(
        tp.grow(512 * MIB),
        Err(StorageError::InvalidArgument { .. })
    ));
    // Reopening with a larger configured size grows too.
    let cfg = TestPool::config_in(tp.dir(), GIB);
    let again = Pool::open(&cfg).expect("reopen");
    assert_eq!(again.usage().expect("usage").image_size_bytes, Some(GIB));
}

#[test]
fn unmount_image_waits_out_a_busy_mount_and_detaches_the_loop() {
    let dir = tempfile::Builder::new()
        .prefix("strata-storage-test-")
        .tempdir_in("/tmp")
        .expect("tmp");
    let cfg = TestPool::config_in(dir.path(), GIB);
    let pool = Pool::open(&cfg).expect("create pool");
    let root = pool.root().to_path_buf();
    let image = dir.path().join("pool.img");
    // Nobody unmounts it: as after a killed process.
    std::mem::forget(pool);
    // A file held open keeps the mount busy for a moment, as a VM being
    // killed does.
    let held = File::create(root.join("busy")).expect("open a file in the pool");
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(400));
        drop(held);
    });
    strata_storage::unmount_image(&root, &image, std::time::Duration::from_secs(10))
        .expect("unmount");
    release.join().expect("release thread");
    assert!(!is_mounted(&root));
    let loops = std::process::Command::new("losetup")
        .arg("-j")
        .arg(&image)
        .output()
        .expect("losetup");
    assert!(loops.stdout.is_empty(), "loop device left: {:?}", loops);
    // Not mounted any more: a second call is fine.
    strata_storage::unmount_image(&root, &image, std::time::Duration::from_secs(1))
        .expect("unmount again");
    // A busy mount that never frees up is an error after the wait.
    let pool = Pool::open(&cfg).expect("mount again");
    let root = pool.root().to_path_buf();
    std::mem::forget(pool);
    let held = File::create(root.join("busy2")).expect("open");
    let e = strata_storage::unmount_image(&root, &image, std::time::Duration::from_millis(300));
    assert!(e.is_err(), "busy mount reported");
    drop(held);
    strata_storage::unmount_image(&root, &image, std::time::Duration::from_secs(10))
        .expect("unmount once free");
}

/// Overwrites `mib` MiB at offset `at_mib` of an existing file and fsyncs.
fn overwrite(path: &Path, at_mib: u64, mib: u64, seed: u64) {
    let mut f = OpenOptions::new().write(true).open(path).expect("open");
    f.seek(SeekFrom::Start(at_mib * MIB)).expect("seek");
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..mib {
        for (j, chunk) in buf.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&(seed ^ (i * MIB + j as u64 * 8 + 7)).to_le_bytes());
        }
        f.write_all(&buf).expect("write");
    }
    f.sync_all().expect("fsync");
}

#[test]
fn written_since_charges_a_snapshot_only_for_its_lineage_writes() {
    let tp = TestPool::new(GIB).expect("pool");
    // A "template": 48 MiB of disk.
    let tpl = tp.create_subvolume("sandboxes/tpl").expect("tpl");
    write_file(&tpl.join("disk.img"), 48);
    let tpl_snap = tp.snapshot(&tpl, "templates/tpl", true).expect("template");
    // A sandbox from it writes 16 MiB, snapshot s1; then 8 more, snapshot s2.
    let sb = tp.snapshot(&tpl_snap, "sandboxes/a", false).expect("a");
    overwrite(&sb.join("disk.img"), 0, 16, 1);
    let s1 = tp.snapshot(&sb, "snapshots/a1", true).expect("s1");
    overwrite(&sb.join("disk.img"), 20, 8, 2);
    fs::write(sb.join("device.state"), vec![5u8; 3 * MIB as usize]).expect("state");
    File::open(sb.join("device.state"))
        .unwrap()
        .sync_all()
        .unwrap();
    let s2 = tp.snapshot(&sb, "snapshots/a2", true).expect("s2");

    let everything = tp.written_since(&tpl_snap, None).expect("all");
    assert!(everything >= 48 * MIB, "{everything}");
    let c1 = tp.written_since(&s1, Some(&tpl_snap)).expect("c1");
    assert_eq!(c1, 16 * MIB, "first snapshot: what the sandbox wrote");
    let c2 = tp.written_since(&s2, Some(&s1)).expect("c2");
    assert_eq!(
        c2,
        8 * MIB + 3 * MIB,
        "second: only what was written after s1"
    );
    // A fork of s2 (a writable snapshot of it) has written nothing yet.
    let fork = tp.snapshot(&s2, "sandboxes/f", false).expect("fork");
    let f1 = tp.snapshot(&fork, "snapshots/f1", true).expect("f1");
    assert_eq!(tp.written_since(&f1, Some(&s2)).expect("fork"), 0);
    // ... and is charged what it writes.
    overwrite(&fork.join("disk.img"), 40, 4, 3);
    let f2 = tp.snapshot(&fork, "snapshots/f2", true).expect("f2");
    assert_eq!(tp.written_since(&f2, Some(&f1)).expect("fork"), 4 * MIB);
    assert!(tp.written_since(&f2, Some(Path::new("/etc"))).is_err());
}

#[test]
fn simple_quotas_enable_by_ioctl_where_the_kernel_has_them() {
    let tp = TestPool::new(GIB).expect("pool");
    if !strata_storage::kernel_has_simple_quotas() {
        assert!(tp.enable_simple_quotas().is_err());
        return;
    }
    tp.enable_simple_quotas().expect("enable simple quotas");
    assert_eq!(tp.quota_status().expect("status"), QuotaStatus::Simple);
    let a = tp.create_subvolume("sandboxes/a").expect("a");
    write_file(&a.join("disk.img"), 32);
    let s = tp.snapshot(&a, "snapshots/a1", true).expect("snap");
    // A snapshot of `a` writes nothing: its extents stay charged to `a`.
    let fork = tp.snapshot(&s, "sandboxes/f", false).expect("fork");
    overwrite(&fork.join("disk.img"), 0, 4, 9);
    let ua = tp
        .subvolume_usage(&a, UsageMethod::Qgroups)
        .expect("a usage");
    let uf = tp
        .subvolume_usage(&fork, UsageMethod::Qgroups)
        .expect("f usage");
    assert!(ua.exclusive_bytes >= 32 * MIB, "{ua:?}");
    assert!(
        uf.exclusive_bytes >= 4 * MIB && uf.exclusive_bytes < 8 * MIB,
        "a fork owns what it wrote: {uf:?}"
    );
}

#[test]
fn reserve_is_released_when_the_pool_runs_low_and_others_keep_writing() {
    let tp = TestPool::new(512 * MIB).expect("pool");
    let before = tp.usage().expect("usage").free_bytes;
    tp.keep_reserve(96 * MIB, 48 * MIB).expect("reserve");
    let reserve = tp.root().join(strata_storage::RESERVE_FILE);
    assert!(fs::metadata(&reserve).expect("reserve").blocks() * 512 >= 96 * MIB);
    let held = tp.usage().expect("usage").free_bytes;
    assert!(
        held + 90 * MIB <= before,
        "the reserve takes its room: {before} -> {held}"
    );
    // Sandbox a fills the pool until less than the low water mark is free.
    let a = tp.create_subvolume("sandboxes/a").expect("a");
    let b = tp.create_subvolume("sandboxes/b").expect("b");
    let mut i = 0;
    while tp.usage().expect("usage").free_bytes > 40 * MIB {
        write_file(&a.join(format!("f{i}")), 8);
        i += 1;
        assert!(i < 200, "pool never filled");
    }
    let low = tp.usage().expect("usage").free_bytes;
    assert!(low < 64 * MIB, "{low}");
    // The watcher (200 ms) releases the reserve on its own.
    let t0 = std::time::Instant::now();
    while !tp.reserve_status().expect("kept").released {
        assert!(t0.elapsed().as_secs() < 10, "reserve never released");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!reserve.exists(), "the reserve file is gone");
    // Strata's own writes still see the pool as low ...
    assert!(tp.usage().expect("usage").free_bytes < 64 * MIB);
    // ... while another sandbox's running writes (64 MiB, more than was free
    // before the release) succeed.
    write_file(&b.join("disk.img"), 64);
    // Space comes back: the reserve is taken again.
    for j in 0..i {
        fs::remove_file(a.join(format!("f{j}"))).expect("rm");
    }
    fs::remove_file(b.join("disk.img")).expect("rm");
    subvol::sync_fs(tp.root()).expect("sync");
    let t0 = std::time::Instant::now();
    loop {
        subvol::sync_fs(tp.root()).expect("sync");
        if !tp.check_reserve().expect("check").expect("kept").released {
            break;
        }
        assert!(t0.elapsed().as_secs() < 20, "reserve never re-allocated");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(reserve.exists());
    tp.keep_reserve(0, 0).expect("off");
    assert!(!reserve.exists() && tp.reserve_status().is_none());
}

#[test]
fn commit_transaction_commits_what_was_written_back_and_moves_on() {
    let tp = TestPool::new(GIB).expect("pool");
    let a = tp.create_subvolume("sandboxes/a").expect("a");
    let path = a.join("mem");
    write_file(&path, 8);
    let first = tp.commit_transaction().expect("commit");
    // Nothing written since: no newer transaction than that one needs to be.
    let again = tp.commit_transaction().expect("commit again");
    assert!(again >= first, "{again} before {first}");
    // A page written back after it lands in a later transaction, which the
    // next call commits (a snapshot made then has nothing of it left to commit).
    let mut f = OpenOptions::new().write(true).open(&path).expect("open");
    f.seek(SeekFrom::Start(4 * MIB)).expect("seek");
    f.write_all(&[7u8; 4096]).expect("write");
    f.sync_data().expect("fdatasync");
    let second = tp.commit_transaction().expect("commit after a write");
    assert!(second > again, "{second} after {again}");
    let snap = tp
        .snapshot(&a, "snapshots/s1", true)
        .expect("snapshot after the commit");
    let mut x = vec![0u8; 4096];
    let mut g = File::open(snap.join("mem")).expect("open the snapshot's copy");
    g.seek(SeekFrom::Start(4 * MIB)).expect("seek");
    g.read_exact(&mut x).expect("read");
    assert_eq!(x, vec![7u8; 4096]);
}

/// A copy caught up after writes through a shared mapping (QEMU's RAM file)
/// and through `pwrite`, in a sparse file, is byte-identical to the file, and
/// the catch-up reflinks only what was written after the copy began.
#[test]
fn a_copy_caught_up_equals_the_file_and_copies_only_what_changed() {
    use strata_storage::catchup;
    let tp = TestPool::new(GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/vm").expect("create");
    let (mem, copy) = (sb.join("mem"), sb.join("mem.copy"));
    let len = 64 * MIB as usize;
    // Half the pages written, the rest holes.
    let mut ram = RamFile::new(&mem, len, 0x9e37_79b9_7f4a_7c15);
    for round in 0..3 {
        let mark = catchup::begin(tp.root(), &mem, &copy).expect("begin");
        // After the copy: pages changed through the mapping (some dirty and
        // never written back before the catch-up), others by pwrite, one in
        // a hole, and the last page.
        let changed = ram.touch();
        let v = ram.next();
        ram.ram()[len - 8..].copy_from_slice(&v.to_le_bytes());
        if round == 1 {
            // Some of it written back and committed in between.
            subvol::sync_fs(tp.root()).expect("sync");
        }
        let done = catchup::catch_up(&mem, &copy, mark).expect("catch up");
        assert_eq!(
            fs::read(&copy).expect("read copy"),
            fs::read(&mem).expect("read mem"),
            "round {round}: the copy differs from the file"
        );
        assert!(done.ranges > 0 && !done.whole, "round {round}: {done:?}");
        // Bounded by what changed (write-back batches neighbours; far from
        // the 32 MiB written before the copy).
        assert!(
            done.bytes <= 64 * changed + 8 * MIB,
            "round {round}: caught up {done:?} for {changed} bytes changed"
        );
        println!("round {round}: {done:?} for ~{changed} bytes changed");
        fs::remove_file(&copy).expect("rm copy");
    }
    // A hole punched after the copy began (QEMU on a guest's discard) leaves
    // no item to find: the catch-up sees the copy hold more bytes than the
    // file and reflinks it whole.
    let mark = catchup::begin(tp.root(), &mem, &copy).expect("begin");
    ram.ram()[4096..8192].copy_from_slice(&[0x5a; 4096]);
    ram.punch_hole(16 * MIB as i64, MIB as i64);
    let done = catchup::catch_up(&mem, &copy, mark).expect("catch up");
    assert!(done.whole, "{done:?}");
    assert_eq!(
        fs::read(&copy).expect("read copy"),
        fs::read(&mem).expect("read mem"),
        "after a punched hole"
    );
    // Without a removed range the copy is not reflinked whole.
    fs::remove_file(&copy).expect("rm copy");
    let mark = catchup::begin(tp.root(), &mem, &copy).expect("begin");
    let v = ram.next();
    ram.ram()[8192..8200].copy_from_slice(&v.to_le_bytes());
    let done = catchup::catch_up(&mem, &copy, mark).expect("catch up");
    assert!(!done.whole && done.ranges > 0, "{done:?}");
    fs::remove_file(&copy).expect("rm copy");
    // A file whose size changed is refused (a truncation leaves no item).
    let mark = catchup::begin(tp.root(), &mem, &copy).expect("begin");
    let f = ram.f.try_clone().expect("dup");
    drop(ram);
    f.set_len(len as u64 / 2).expect("truncate");
    assert!(matches!(
        catchup::catch_up(&mem, &copy, mark),
        Err(StorageError::InvalidArgument { .. })
    ));
}

/// A guest-RAM-like file for the catch-up tests: mapped shared (as QEMU maps
/// guest RAM), half its pages written and the rest holes, and a fixed-seed
/// pseudo-random sequence (xorshift) for what is written next.
struct RamFile {
    f: File,
    ptr: *mut libc::c_void,
    len: usize,
    x: u64,
}

impl RamFile {
    fn new(path: &Path, len: usize, seed: u64) -> RamFile {
        let (f, ptr) = map_new_file(path, len);
        let mut r = RamFile {
            f,
            ptr,
            len,
            x: seed,
        };
        let pages = len / 4096;
        for _ in 0..pages / 2 {
            let p = (r.next() as usize) % pages;
            let v = r.next();
            r.ram()[p * 4096..p * 4096 + 8].copy_from_slice(&v.to_le_bytes());
        }
        r
    }

    fn next(&mut self) -> u64 {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        self.x
    }

    fn ram(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes until `Drop` unmaps them;
        // the slice borrows `self`, so it cannot outlive the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// Changes 40 random pages through the mapping (some left dirty) and 8
    /// bytes by `pwrite`; returns about the bytes changed.
    fn touch(&mut self) -> u64 {
        use std::os::unix::fs::FileExt;
        let pages = self.len / 4096;
        let mut changed = 0u64;
        for _ in 0..40 {
            let p = (self.next() as usize) % pages;
            let v = self.next();
            self.ram()[p * 4096 + 100..p * 4096 + 108].copy_from_slice(&v.to_le_bytes());
            changed += 4096;
        }
        let (v, at) = (self.next(), self.next());
        self.f
            .write_at(&v.to_le_bytes(), (at % (self.len as u64 - 8)) & !7)
            .expect("pwrite");
        changed
    }

    /// Punches a hole (`fallocate(PUNCH_HOLE)`, as QEMU does on a guest's
    /// discard) of `len` bytes at `off`.
    fn punch_hole(&self, off: i64, len: i64) {
        // SAFETY: `f` is open for writing; the caller keeps the range inside the file.
        let r = unsafe {
            libc::fallocate(
                self.f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        assert_eq!(r, 0, "punch hole: {}", std::io::Error::last_os_error());
    }
}

impl Drop for RamFile {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `new`, not used after this.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

/// The copies made by a snapshot of the subvolume (`catchup::begin_snapshot`):
/// after writes through the mapping and `pwrite`, the snapshot's file caught
/// up equals the file, only what changed is cloned, the snapshot stays a
/// snapshot of the subvolume (its parent UUID), and its other files keep
/// their state of the snapshot's time. A punched hole makes it whole.
#[test]
fn a_snapshot_caught_up_equals_the_file_and_keeps_its_lineage() {
    use strata_storage::catchup;
    let tp = TestPool::new(GIB).expect("pool");
    let sb = tp.create_subvolume("sandboxes/vm").expect("create");
    fs::create_dir_all(tp.root().join("snapshots")).expect("snapshots dir");
    let mem = sb.join("mem");
    let mut ram = RamFile::new(&mem, 64 * MIB as usize, 0x2545_f491_4f6c_dd1d);
    let parent = strata_storage::send::subvol_info(&sb).expect("info").uuid;
    for round in 0..3 {
        fs::write(sb.join("meta"), format!("before {round}")).expect("meta");
        let snap = tp.root().join(format!("snapshots/s{round}"));
        let marks = catchup::begin_snapshot(&sb, &snap, &["mem"]).expect("begin");
        let info = strata_storage::send::subvol_info(&snap).expect("snap info");
        assert_eq!(
            info.parent_uuid,
            Some(parent),
            "a snapshot of the subvolume"
        );
        assert!(!info.readonly);
        fs::write(sb.join("meta"), format!("after {round}")).expect("meta");
        let changed = ram.touch();
        if round == 1 {
            subvol::sync_fs(tp.root()).expect("sync");
        }
        let done = catchup::catch_up(&mem, &snap.join("mem"), marks[0]).expect("catch up");
        assert_eq!(
            fs::read(snap.join("mem")).expect("read snapshot's mem"),
            fs::read(&mem).expect("read mem"),
            "round {round}: the snapshot's RAM differs from the file"
        );
        assert!(done.ranges > 0 && !done.whole, "round {round}: {done:?}");
        assert!(
            done.bytes <= 64 * changed + 8 * MIB,
            "round {round}: caught up {done:?} for {changed} bytes changed"
        );
        assert_eq!(
            fs::read_to_string(snap.join("meta")).expect("meta"),
            format!("before {round}"),
            "the snapshot's other files are of its own time"
        );
    }
    let snap = tp.root().join("snapshots/holes");
    let marks = catchup::begin_snapshot(&sb, &snap, &["mem"]).expect("begin");
    ram.punch_hole(16 * MIB as i64, MIB as i64);
    let done = catchup::catch_up(&mem, &snap.join("mem"), marks[0]).expect("catch up");
    assert!(done.whole, "{done:?}");
    assert_eq!(
        fs::read(snap.join("mem")).expect("read"),
        fs::read(&mem).expect("read mem")
    );
}
