//! The pool: where it lives (a btrfs path, or an image file strata formats and
//! loop-mounts), its layout, and the pool-checked subvolume operations.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Result, StorageError};
use crate::usage::{self, QuotaStatus, SubvolUsage};
use crate::{ioctl, mountinfo, subvol};

/// Mount options of an image pool. No `compress`: guest RAM files are written on
/// every snapshot and compressing them would put CPU work into the pause.
/// `discard=async` gives space of deleted snapshots back to the host file system
/// (holes punched into the sparse image).
pub const MOUNT_OPTIONS: &str = "noatime,user_subvol_rm_allowed,discard=async";

/// Smallest image `mkfs.btrfs` accepts with the default profiles is ~114 MiB.
pub const MIN_IMAGE_SIZE: u64 = 128 << 20;

/// Sub-directories created in the pool root on open.
pub const LAYOUT: [&str; 4] = ["sandboxes", "snapshots", "templates", "trash"];

/// Where the pool lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolConfig {
    /// An existing directory on a mounted btrfs file system.
    Path(PathBuf),
    /// An image file strata creates (sparse), formats with `mkfs.btrfs` and loop-mounts
    /// at `mount_point`. Reused if it exists (grown if `size_bytes` is larger) and
    /// if it is already mounted there.
    Image {
        /// The image file.
        image: PathBuf,
        /// Its size in bytes (at least [`MIN_IMAGE_SIZE`]).
        size_bytes: u64,
        /// The directory it is mounted on (created if missing).
        mount_point: PathBuf,
    },
}

/// Options of [`Pool::open_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolOptions {
    /// Enable btrfs quota groups on open. Off by default: quotas make every snapshot
    /// slower (see `docs/storage.md`); usage is then computed by extent walk.
    pub quotas: bool,
}

/// How [`Pool::subvolume_usage`] computes its numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageMethod {
    /// Quota groups if enabled and consistent, otherwise the extent walk.
    #[default]
    Auto,
    /// Extent walk with FIEMAP (like `btrfs filesystem du`).
    Extents,
    /// Quota groups (error if quotas are off).
    Qgroups,
}

/// Pool-wide space, from `statvfs` on the pool root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    /// Size of the file system.
    pub total_bytes: u64,
    /// Bytes in use (data and metadata, as btrfs reports to statfs).
    pub used_bytes: u64,
    /// Bytes still available for new data.
    pub free_bytes: u64,
    /// Image mode: the image file's apparent size.
    pub image_size_bytes: Option<u64>,
    /// Image mode: the host disk space the sparse image file really occupies.
    pub image_allocated_bytes: Option<u64>,
}

#[derive(Debug)]
struct ImageMount {
    image: PathBuf,
    mount_point: PathBuf,
}

/// An open btrfs storage pool.
///
/// All methods are synchronous (ioctls, a few milliseconds); async callers run them in
/// `spawn_blocking`. Paths given to methods may be absolute (inside the pool) or
/// relative to [`Pool::root`].
#[derive(Debug)]
pub struct Pool {
    root: PathBuf,
    image: Option<ImageMount>,
    trash: Trash,
    reserve: Mutex<Option<Reserve>>,
}

/// Name of the space reserve file in the pool root (see [`Pool::keep_reserve`]).
pub const RESERVE_FILE: &str = ".reserve";

/// How often the reserve watcher looks at the pool's free space.
const RESERVE_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// What the space reserve is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveStatus {
    /// Size of the reserve.
    pub bytes: u64,
    /// Free space (reserve excluded) below which it is released.
    pub low_water_bytes: u64,
    /// True while it is released (the pool ran low; running guests write into it).
    pub released: bool,
}

impl Pool {
    /// Opens (and in image mode creates and mounts) the pool with default options.
    pub fn open(config: &PoolConfig) -> Result<Pool> {
        Pool::open_with(config, PoolOptions::default())
    }

    /// Opens (and in image mode creates and mounts) the pool.
    pub fn open_with(config: &PoolConfig, options: PoolOptions) -> Result<Pool> {
        let (root, image) = match config {
            PoolConfig::Path(p) => {
                let root =
                    std::fs::canonicalize(p).map_err(|e| StorageError::io("open pool", p, e))?;
                if !root.is_dir() {
                    return Err(StorageError::InvalidArgument {
                        what: root.display().to_string(),
                        reason: "the pool path must be a directory".into(),
                    });
                }
                subvol::ensure_btrfs(&root)?;
                (root, None)
            }
            PoolConfig::Image {
                image,
                size_bytes,
                mount_point,
            } => {
                let (root, image) = open_image(image, *size_bytes, mount_point)?;
                (
                    root.clone(),
                    Some(ImageMount {
                        image,
                        mount_point: root,
                    }),
                )
            }
        };
        for d in LAYOUT {
            let p = root.join(d);
            match std::fs::create_dir(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(StorageError::io("create pool directory", p, e)),
            }
        }
        if options.quotas && usage::quota_status(&root)? == QuotaStatus::Disabled {
            usage::set_quotas(&root, true)?;
        }
        let trash = Trash::start(root.join("trash"));
        let pool = Pool {
            root,
            image,
            trash,
            reserve: Mutex::new(None),
        };
        if let PoolConfig::Image { size_bytes, .. } = config {
            if *size_bytes > pool.image_size()? {
                pool.grow(*size_bytes)?;
            }
        }
        pool.trash.sweep()?;
        tracing::info!(root = %pool.root.display(), image = ?pool.image.as_ref().map(|i| &i.image), "storage pool open");
        Ok(pool)
    }

    /// The pool's root directory (canonical).
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// `<root>/sandboxes`: one subvolume per sandbox.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    /// `<root>/snapshots`: read-only snapshot subvolumes.
    pub fn snapshots_dir(&self) -> PathBuf {
        self.root.join("snapshots")
    }
    /// `<root>/templates`: template snapshot subvolumes.
    pub fn templates_dir(&self) -> PathBuf {
        self.root.join("templates")
    }
    /// `<root>/trash`: subvolumes being deleted in the background.
    pub fn trash_dir(&self) -> PathBuf {
        self.root.join("trash")
    }

    /// Creates an empty subvolume at `path`.
    pub fn create_subvolume(&self, path: impl AsRef<Path>) -> Result<PathBuf> {
        let p = self.inside(path.as_ref())?;
        subvol::create_subvolume(&p)?;
        Ok(p)
    }

    /// Snapshots subvolume `src` to a new subvolume `dst`; see [`subvol::snapshot`].
    pub fn snapshot(
        &self,
        src: impl AsRef<Path>,
        dst: impl AsRef<Path>,
        readonly: bool,
    ) -> Result<PathBuf> {
        let s = self.inside(src.as_ref())?;
        let d = self.inside(dst.as_ref())?;
        subvol::snapshot(&s, &d, readonly)?;
        Ok(d)
    }

    /// Commits the pool's running btrfs transaction and waits for it, writing
    /// back no file's data; see [`subvol::commit_transaction`].
    pub fn commit_transaction(&self) -> Result<u64> {
        subvol::commit_transaction(&self.root)
    }

    /// Deletes subvolume `path` now (the ioctl returns once it is unlinked; blocks are
    /// freed later by btrfs). Prefer [`Pool::trash`] on latency-sensitive paths.
    pub fn delete_subvolume(&self, path: impl AsRef<Path>) -> Result<()> {
        subvol::delete_subvolume(&self.inside(path.as_ref())?)
    }

    /// True if `path` is a subvolume.
    pub fn is_subvolume(&self, path: impl AsRef<Path>) -> Result<bool> {
        subvol::is_subvolume(&self.inside(path.as_ref())?)
    }

    /// Makes subvolume `path` read-only or writable.
    pub fn set_readonly(&self, path: impl AsRef<Path>, readonly: bool) -> Result<()> {
        subvol::set_readonly(&self.inside(path.as_ref())?, readonly)
    }

    /// True if subvolume `path` is read-only.
    pub fn is_readonly(&self, path: impl AsRef<Path>) -> Result<bool> {
        subvol::is_readonly(&self.inside(path.as_ref())?)
    }

    /// Creates file `dst` sharing all extents of file `src` (FICLONE).
    pub fn reflink_file(&self, src: impl AsRef<Path>, dst: impl AsRef<Path>) -> Result<()> {
        subvol::reflink_file(&self.inside(src.as_ref())?, &self.inside(dst.as_ref())?)
    }

    /// Makes existing file `dst` share all extents of file `src`, keeping
    /// its inode; see [`subvol::reflink_over`].
    pub fn reflink_over(&self, src: impl AsRef<Path>, dst: impl AsRef<Path>) -> Result<()> {
        subvol::reflink_over(&self.inside(src.as_ref())?, &self.inside(dst.as_ref())?)
    }

    /// Moves `path` (a subvolume, directory or file) into `trash/` with one atomic
    /// rename and deletes it on a background thread. Returns once it is gone from its
    /// old place.
    pub fn trash(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = self.inside(path.as_ref())?;
        if p.parent() == Some(self.trash_dir().as_path()) {
            return Err(StorageError::InvalidArgument {
                what: p.display().to_string(),
                reason: "already in the trash".into(),
            });
        }
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = self.trash_dir().join(format!("{}-{name}", unique_stamp()));
        // A read-only subvolume cannot be renamed (its `..` entry would change).
        // It is destroyed where it is instead: the ioctl unlinks it at once (one
        // atomic step, like the rename) and btrfs's cleaner frees its blocks later,
        // as it would in the trash. Clearing the flag to rename it would commit the
        // pool's transaction (`BTRFS_IOC_SUBVOL_SETFLAGS` does), and a commit
        // beside a snapshot's pause lengthens it (docs/bench/soak.md).
        let was_ro = subvol::is_subvolume(&p)? && subvol::is_readonly(&p)?;
        if was_ro {
            match subvol::delete_subvolume(&p) {
                Ok(()) => return Ok(()),
                // Nested subvolumes inside, or a caller not allowed to destroy a
                // read-only subvolume: made writable and through the trash, as before.
                Err(e) => {
                    tracing::debug!(path = %p.display(), error = %e, "destroying a read-only subvolume in place failed; trashing it");
                    subvol::set_readonly(&p, false)?;
                }
            }
        }
        if let Err(e) = std::fs::rename(&p, &target) {
            if was_ro {
                let _ = subvol::set_readonly(&p, true);
            }
            return Err(StorageError::io("move to trash", &p, e));
        }
        self.trash.push(target);
        Ok(())
    }

    /// Blocks until everything trashed so far has been deleted.
    pub fn wait_trash_empty(&self) {
        self.trash.wait_idle();
    }

    /// Pool-wide space. `free_bytes` never counts the space reserve: while it
    /// is held the file system does not either, and while it is released (the
    /// pool ran low, see [`Pool::keep_reserve`]) its size is taken off, so
    /// what strata itself writes (snapshots, new sandboxes) stays refused and
    /// the released room is left to the guests already running.
    pub fn usage(&self) -> Result<PoolUsage> {
        let mut u = self.raw_usage()?;
        if let Some(r) = self.reserve_status() {
            if r.released {
                u.free_bytes = u.free_bytes.saturating_sub(r.bytes);
            }
        }
        Ok(u)
    }

    fn raw_usage(&self) -> Result<PoolUsage> {
        let st = statvfs(&self.root)?;
        let f = st.f_frsize;
        let (image_size_bytes, image_allocated_bytes) = match &self.image {
            Some(i) => {
                let md = std::fs::metadata(&i.image)
                    .map_err(|e| StorageError::io("stat", &i.image, e))?;
                (Some(md.len()), Some(md.blocks() * 512))
            }
            None => (None, None),
        };
        Ok(PoolUsage {
            total_bytes: st.f_blocks * f,
            used_bytes: st.f_blocks.saturating_sub(st.f_bfree) * f,
            free_bytes: st.f_bavail * f,
            image_size_bytes,
            image_allocated_bytes,
        })
    }

    /// Exclusive / referenced bytes of subvolume `path`. Not for the hot path: the
    /// extent walk reads all of the subvolume's extent metadata.
    pub fn subvolume_usage(
        &self,
        path: impl AsRef<Path>,
        method: UsageMethod,
    ) -> Result<SubvolUsage> {
        let p = self.inside(path.as_ref())?;
        if !subvol::is_subvolume(&p)? {
            return Err(StorageError::NotASubvolume { path: p });
        }
        match method {
            UsageMethod::Extents => usage::extent_usage(&p),
            UsageMethod::Qgroups => usage::qgroup_usage(&p),
            UsageMethod::Auto => match usage::quota_status(&self.root)? {
                QuotaStatus::Enabled => usage::qgroup_usage(&p),
                _ => usage::extent_usage(&p),
            },
        }
    }

    /// Turns btrfs quota groups on (waiting for the initial rescan) or off.
    pub fn set_quotas(&self, enable: bool) -> Result<()> {
        usage::set_quotas(&self.root, enable)
    }

    /// Turns btrfs simple quotas on (Linux 6.7+; see
    /// [`usage::enable_simple_quotas`]). No limit is ever set.
    pub fn enable_simple_quotas(&self) -> Result<()> {
        usage::enable_simple_quotas(&self.root)
    }

    /// Bytes of subvolume `path` written since it shared its data with
    /// `base` (a snapshot against the one it descends from; `None`: all of
    /// its allocated bytes). See [`usage::written_bytes`].
    pub fn written_since(&self, path: impl AsRef<Path>, base: Option<&Path>) -> Result<u64> {
        let p = self.inside(path.as_ref())?;
        let b = match base {
            Some(b) => Some(self.inside(b)?),
            None => None,
        };
        usage::written_bytes(&p, b.as_deref())
    }

    /// Keeps a space reserve: a file `<root>/.reserve` of `bytes`, allocated
    /// with `fallocate` (no data written). A watcher thread looks at the free
    /// space every 200 ms: below `low_water_bytes` it deletes the file, so the
    /// guests already running keep writing when the pool is nearly full
    /// (one warning in the log); once free space is back above
    /// `bytes + 2 × low_water_bytes` it allocates the file again (one info
    /// line). [`Pool::usage`] never counts the reserve as free. `bytes = 0`
    /// stops keeping one (the file is removed). Calling it again replaces the
    /// previous setting.
    pub fn keep_reserve(&self, bytes: u64, low_water_bytes: u64) -> Result<()> {
        let mut g = self.reserve.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut old) = g.take() {
            old.stop();
        }
        let path = self.root.join(RESERVE_FILE);
        if bytes == 0 {
            return match std::fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(StorageError::io("remove reserve", &path, e)),
            };
        }
        let state = Arc::new(ReserveState {
            path,
            root: self.root.clone(),
            bytes,
            low_water: low_water_bytes,
            released: std::sync::atomic::AtomicBool::new(false),
            stop: (Mutex::new(false), Condvar::new()),
        });
        match state.allocate() {
            Ok(()) => {
                tracing::info!(bytes, path = %state.path.display(), "storage pool space reserve held")
            }
            Err(e) if e.is_no_space() => {
                state.released.store(true, Ordering::SeqCst);
                tracing::warn!(bytes, "storage pool has no room for its space reserve; it is allocated once space is back");
            }
            Err(e) => return Err(e),
        }
        let s2 = state.clone();
        let worker = std::thread::Builder::new()
            .name("strata-reserve".into())
            .spawn(move || s2.watch())
            .map_err(|e| StorageError::io("start reserve watcher", &self.root, e))?;
        *g = Some(Reserve {
            state,
            worker: Some(worker),
        });
        Ok(())
    }

    /// The reserve's state, if one is kept.
    pub fn reserve_status(&self) -> Option<ReserveStatus> {
        let g = self.reserve.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().map(|r| r.state.status())
    }

    /// Runs one step of the reserve watcher now (release when low, re-allocate
    /// when space is back) and returns the reserve's state.
    pub fn check_reserve(&self) -> Result<Option<ReserveStatus>> {
        let state = {
            let g = self.reserve.lock().unwrap_or_else(|p| p.into_inner());
            match g.as_ref() {
                Some(r) => r.state.clone(),
                None => return Ok(None),
            }
        };
        state.step()?;
        Ok(Some(state.status()))
    }

    /// Whether quota groups are on.
    pub fn quota_status(&self) -> Result<QuotaStatus> {
        usage::quota_status(&self.root)
    }

    /// Image mode: the image file and its mount point.
    pub fn image(&self) -> Option<(&Path, &Path)> {
        self.image
            .as_ref()
            .map(|i| (i.image.as_path(), i.mount_point.as_path()))
    }

    fn image_size(&self) -> Result<u64> {
        match &self.image {
            Some(i) => std::fs::metadata(&i.image)
                .map(|m| m.len())
                .map_err(|e| StorageError::io("stat", &i.image, e)),
            None => Ok(0),
        }
    }

    /// Image mode: grows the image file to `new_size` bytes and the file system with it
    /// (`LOOP_SET_CAPACITY` + `BTRFS_IOC_RESIZE max`), online. Shrinking is refused.
    pub fn grow(&self, new_size: u64) -> Result<()> {
        let Some(img) = &self.image else {
            return Err(StorageError::InvalidArgument {
                what: "grow".into(),
                reason: "only an image pool can be grown; grow the btrfs file system under a path pool yourself".into(),
            });
        };
        let old = self.image_size()?;
        if new_size < old {
            return Err(StorageError::InvalidArgument {
                what: format!("new size {new_size}"),
                reason: format!(
                    "smaller than the current image size {old}; shrinking is not supported"
                ),
            });
        }
        let m = mountinfo::mount_at(&img.mount_point)
            .map_err(|e| StorageError::io("read mountinfo", "/proc/self/mountinfo", e))?
            .ok_or_else(|| StorageError::NotFound {
                path: img.mount_point.clone(),
            })?;
        let f = OpenOptions::new()
            .write(true)
            .open(&img.image)
            .map_err(|e| StorageError::io("open", &img.image, e))?;
        f.set_len(new_size)
            .map_err(|e| StorageError::io("grow image", &img.image, e))?;
        let dev = OpenOptions::new()
            .read(true)
            .open(&m.source)
            .map_err(|e| StorageError::io("open", &m.source, e))?;
        // SAFETY: LOOP_SET_CAPACITY takes no argument; `dev` is the pool's loop device.
        unsafe { ioctl::ioctl_val(dev.as_fd(), ioctl::LOOP_SET_CAPACITY, 0) }
            .map_err(|e| StorageError::io("loop set capacity", &m.source, e))?;
        let dir = subvol::open_dir(&self.root)?;
        let mut args = ioctl::VolArgs::zeroed();
        ioctl::fill_name(&mut args.name, b"max").ok_or_else(|| StorageError::InvalidArgument {
            what: "resize".into(),
            reason: "name".into(),
        })?;
        // SAFETY: BTRFS_IOC_RESIZE takes a `struct btrfs_ioctl_vol_args` whose name is
        // the size spec ("max": the whole device 1).
        unsafe { ioctl::ioctl_ptr(dir.as_fd(), ioctl::BTRFS_IOC_RESIZE, &mut *args) }
            .map_err(|e| StorageError::io("resize file system", &self.root, e))?;
        tracing::info!(image = %img.image.display(), old, new_size, "storage pool grown");
        Ok(())
    }

    /// Stops the trash thread (after it has emptied the trash) and, in image mode,
    /// unmounts the pool and detaches its loop device. The image file stays.
    pub fn unmount(mut self) -> Result<()> {
        if let Some(mut r) = self
            .reserve
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            r.stop();
        }
        self.trash.stop();
        let Some(img) = self.image.take() else {
            return Ok(());
        };
        let c = subvol::cpath(&img.mount_point)?;
        // SAFETY: `c` is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
            return Err(StorageError::io(
                "unmount",
                &img.mount_point,
                io::Error::last_os_error(),
            ));
        }
        detach_loops(&img.image);
        tracing::info!(mount_point = %img.mount_point.display(), "storage pool unmounted");
        Ok(())
    }

    /// Resolves `path` (absolute or relative to the root) and checks it names an entry
    /// strictly inside the pool. The final component need not exist.
    pub(crate) fn inside(&self, path: &Path) -> Result<PathBuf> {
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.root.join(path)
        };
        let (parent, name) = subvol::split(&abs)?;
        if name == "." || name == ".." {
            return Err(StorageError::InvalidArgument {
                what: path.display().to_string(),
                reason: "must end in a name".into(),
            });
        }
        let parent =
            std::fs::canonicalize(&parent).map_err(|e| StorageError::io("resolve", &parent, e))?;
        if !parent.starts_with(&self.root) {
            return Err(StorageError::OutsidePool {
                path: abs,
                root: self.root.clone(),
            });
        }
        Ok(parent.join(name))
    }
}

fn unique_stamp() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{t}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Finds `tool` in PATH or the sbin directories.
pub(crate) fn find_tool(tool: &'static str, package: &'static str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
        .ok_or(StorageError::ToolMissing { tool, package })
}

fn run(cmd: &mut Command) -> Result<()> {
    let line = format!("{cmd:?}").replace('"', "");
    let out = cmd
        .output()
        .map_err(|e| StorageError::io("spawn", line.clone(), e))?;
    if !out.status.success() {
        return Err(StorageError::CommandFailed {
            command: line,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// True if `image` holds a btrfs superblock (magic `_BHRfS_M` at 64 KiB + 0x40).
fn has_btrfs_magic(image: &Path) -> Result<bool> {
    let mut f = File::open(image).map_err(|e| StorageError::io("open", image, e))?;
    let mut magic = [0u8; 8];
    f.seek(SeekFrom::Start(0x10040))
        .map_err(|e| StorageError::io("read", image, e))?;
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(&magic == b"_BHRfS_M"),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(StorageError::io("read", image, e)),
    }
}

/// Creates the formatted image at a temporary name and renames it into place, so an
/// image at `image` is always a complete file system.
fn create_image(image: &Path, size: u64) -> Result<()> {
    let mkfs = find_tool("mkfs.btrfs", "btrfs-progs")?;
    if let Some(dir) = image.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| StorageError::io("create directory", dir, e))?;
    }
    let mut tmp = image.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| StorageError::io("create image", &tmp, e))?;
    let res = f
        .set_len(size)
        .map_err(|e| StorageError::io("size image", &tmp, e))
        .and_then(|()| {
            run(Command::new(&mkfs)
                .args(["-q", "-f", "-L", "strata-pool"])
                .arg(&tmp))
        })
        .and_then(|()| f.sync_all().map_err(|e| StorageError::io("sync", &tmp, e)))
        .and_then(|()| {
            std::fs::rename(&tmp, image).map_err(|e| StorageError::io("rename", &tmp, e))
        });
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res?;
    tracing::info!(image = %image.display(), size, "created btrfs pool image");
    Ok(())
}

/// Returns (canonical mount point, canonical image path).
fn open_image(image: &Path, size: u64, mount_point: &Path) -> Result<(PathBuf, PathBuf)> {
    if size < MIN_IMAGE_SIZE {
        return Err(StorageError::InvalidArgument {
            what: format!("image size {size}"),
            reason: format!("a btrfs image needs at least {MIN_IMAGE_SIZE} bytes"),
        });
    }
    std::fs::create_dir_all(mount_point)
        .map_err(|e| StorageError::io("create mount point", mount_point, e))?;
    let mp = std::fs::canonicalize(mount_point)
        .map_err(|e| StorageError::io("resolve", mount_point, e))?;
    if !image.exists() {
        create_image(image, size)?;
    } else if !has_btrfs_magic(image)? {
        return Err(StorageError::NotBtrfs {
            path: image.to_path_buf(),
            fs_type: "non-btrfs image".into(),
        });
    }
    let image = std::fs::canonicalize(image).map_err(|e| StorageError::io("resolve", image, e))?;
    let lookup = |mp: &Path| {
        mountinfo::mount_at(mp)
            .map_err(|e| StorageError::io("read mountinfo", "/proc/self/mountinfo", e))
    };
    if let Some(m) = lookup(&mp)? {
        let ours = m.fs_type == "btrfs"
            && m.root == Path::new("/")
            && mountinfo::loop_backing_file(&m.source).is_some_and(|b| Path::new(&b) == image);
        if !ours {
            return Err(StorageError::MountPointBusy {
                mount_point: mp,
                found: format!("{} from {}", m.fs_type, m.source),
                image,
            });
        }
        tracing::info!(mount_point = %mp.display(), "pool image already mounted, reusing it");
        return Ok((mp, image));
    }
    let mount = find_tool("mount", "mount")?;
    // A loop device left attached to the image (e.g. by a crash) is reused, so that
    // the kernel never sees two devices with the same btrfs fsid.
    let (src, opts) = match mountinfo::loop_devices_of(&image).into_iter().next() {
        Some(dev) => (dev, MOUNT_OPTIONS.to_string()),
        None => (image.clone(), format!("loop,{MOUNT_OPTIONS}")),
    };
    run(Command::new(mount)
        .args(["-t", "btrfs", "-o", &opts])
        .arg(&src)
        .arg(&mp))
    .map_err(|e| StorageError::MountFailed {
        source_path: src.clone(),
        mount_point: mp.clone(),
        reason: e.to_string(),
    })?;
    subvol::ensure_btrfs(&mp)?;
    Ok((mp, image))
}

/// Detaches every loop device still backed by `image` (no-op for auto-cleared ones).
/// Unmounts an image pool that no [`Pool`] value holds any more (the pool of
/// a process that was killed, or of a test or benchmark whose VMs were just
/// killed and may still hold files open for a moment): retries a busy
/// unmount for up to `wait`, then detaches the image's loop devices. A mount
/// point that is not mounted is fine.
pub fn unmount_image(mount_point: &Path, image: &Path, wait: std::time::Duration) -> Result<()> {
    let c = subvol::cpath(mount_point)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        if mountinfo::mount_at(mount_point)
            .map_err(|e| StorageError::io("read mountinfo", mount_point, e))?
            .is_none()
        {
            break;
        }
        // SAFETY: `c` is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) || std::time::Instant::now() >= deadline {
            return Err(StorageError::io("unmount", mount_point, e));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    detach_loops(image);
    Ok(())
}

fn detach_loops(image: &Path) {
    for dev in mountinfo::loop_devices_of(image) {
        if let Ok(f) = File::open(&dev) {
            // SAFETY: LOOP_CLR_FD takes no argument; `f` is a loop device backed by our image.
            let _ = unsafe { ioctl::ioctl_val(f.as_fd(), ioctl::LOOP_CLR_FD, 0) };
        }
    }
}

/// The space reserve and its watcher thread.
#[derive(Debug)]
struct Reserve {
    state: Arc<ReserveState>,
    worker: Option<JoinHandle<()>>,
}

impl Reserve {
    fn stop(&mut self) {
        {
            let (m, cv) = &self.state.stop;
            *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
            cv.notify_all();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug)]
struct ReserveState {
    path: PathBuf,
    root: PathBuf,
    bytes: u64,
    low_water: u64,
    released: std::sync::atomic::AtomicBool,
    stop: (Mutex<bool>, Condvar),
}

impl ReserveState {
    fn status(&self) -> ReserveStatus {
        ReserveStatus {
            bytes: self.bytes,
            low_water_bytes: self.low_water,
            released: self.released.load(Ordering::SeqCst),
        }
    }

    /// Creates the file and allocates its blocks (kept if it already has them).
    fn allocate(&self) -> Result<()> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.path)
            .map_err(|e| StorageError::io("create reserve", &self.path, e))?;
        let len = i64::try_from(self.bytes).map_err(|_| StorageError::InvalidArgument {
            what: format!("reserve of {} bytes", self.bytes),
            reason: "too large".into(),
        })?;
        // SAFETY: `f` is an open, writable file; mode 0 allocates blocks (and
        // extends the size) without writing data.
        if unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, len) } != 0 {
            let e = io::Error::last_os_error();
            drop(f);
            let _ = std::fs::remove_file(&self.path);
            return Err(StorageError::io("fallocate reserve", &self.path, e));
        }
        f.sync_all()
            .map_err(|e| StorageError::io("sync reserve", &self.path, e))
    }

    fn free_bytes(&self) -> Result<u64> {
        let st = statvfs(&self.root)?;
        Ok(st.f_bavail * st.f_frsize)
    }

    /// Releases the reserve when free space is low, takes it back when there
    /// is room again (with a margin, so it does not flap).
    fn step(&self) -> Result<()> {
        let free = self.free_bytes()?;
        let released = self.released.load(Ordering::SeqCst);
        if !released && free < self.low_water {
            match std::fs::remove_file(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(StorageError::io("release reserve", &self.path, e)),
            }
            self.released.store(true, Ordering::SeqCst);
            tracing::warn!(
                free_bytes = free,
                reserve_bytes = self.bytes,
                "storage pool nearly full: released the space reserve so running guests keep writing; snapshots and new sandboxes are refused until space is back"
            );
        } else if released && free >= self.bytes.saturating_add(self.low_water.saturating_mul(2)) {
            match self.allocate() {
                Ok(()) => {
                    self.released.store(false, Ordering::SeqCst);
                    tracing::info!(
                        free_bytes = free,
                        reserve_bytes = self.bytes,
                        "storage pool has room again: space reserve re-allocated"
                    );
                }
                Err(e) if e.is_no_space() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn watch(&self) {
        let (m, cv) = &self.stop;
        let mut stopped = m.lock().unwrap_or_else(|p| p.into_inner());
        while !*stopped {
            drop(stopped);
            if let Err(e) = self.step() {
                tracing::warn!(error = %e, "storage pool reserve check failed");
            }
            stopped = m.lock().unwrap_or_else(|p| p.into_inner());
            if *stopped {
                break;
            }
            stopped = cv
                .wait_timeout(stopped, RESERVE_POLL)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// Background deletion of trashed entries.
#[derive(Debug)]
struct Trash {
    dir: PathBuf,
    tx: Option<mpsc::Sender<PathBuf>>,
    worker: Option<JoinHandle<()>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Trash {
    fn start(dir: PathBuf) -> Trash {
        let (tx, rx) = mpsc::channel::<PathBuf>();
        let pending = Arc::new((Mutex::new(0usize), Condvar::new()));
        let p2 = pending.clone();
        let worker = std::thread::Builder::new()
            .name("strata-trash".into())
            .spawn(move || {
                for path in rx {
                    if let Err(e) = remove_any(&path) {
                        tracing::warn!(path = %path.display(), error = %e, "trash: delete failed");
                    }
                    let (m, cv) = &*p2;
                    let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
                    *n = n.saturating_sub(1);
                    cv.notify_all();
                }
            })
            .ok();
        if worker.is_none() {
            tracing::warn!("could not start the trash thread; trash is deleted inline");
        }
        Trash {
            dir,
            tx: Some(tx),
            worker,
            pending,
        }
    }

    fn push(&self, path: PathBuf) {
        if self.worker.is_none() {
            if let Err(e) = remove_any(&path) {
                tracing::warn!(path = %path.display(), error = %e, "trash: delete failed");
            }
            return;
        }
        {
            let (m, _) = &*self.pending;
            *m.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        }
        if let Some(tx) = &self.tx {
            if tx.send(path).is_err() {
                let (m, cv) = &*self.pending;
                let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
                *n = n.saturating_sub(1);
                cv.notify_all();
            }
        }
    }

    /// Queues what a previous run left in the trash.
    fn sweep(&self) -> Result<()> {
        let rd = std::fs::read_dir(&self.dir)
            .map_err(|e| StorageError::io("read directory", &self.dir, e))?;
        for e in rd.flatten() {
            self.push(e.path());
        }
        Ok(())
    }

    fn wait_idle(&self) {
        let (m, cv) = &*self.pending;
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = cv.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Trash {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Deletes a subvolume, directory tree (with any nested subvolumes) or file.
fn remove_any(path: &Path) -> Result<()> {
    let md = std::fs::symlink_metadata(path).map_err(|e| StorageError::io("stat", path, e))?;
    if md.is_dir() {
        if subvol::is_subvolume(path)? {
            return match subvol::delete_subvolume(path) {
                // Nested subvolumes inside: remove the contents first.
                Err(StorageError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::ENOTEMPTY) =>
                {
                    remove_children(path)?;
                    subvol::delete_subvolume(path)
                }
                r => r,
            };
        }
        remove_children(path)?;
        std::fs::remove_dir(path).map_err(|e| StorageError::io("remove directory", path, e))
    } else {
        std::fs::remove_file(path).map_err(|e| StorageError::io("remove file", path, e))
    }
}

fn remove_children(path: &Path) -> Result<()> {
    let rd = std::fs::read_dir(path).map_err(|e| StorageError::io("read directory", path, e))?;
    for e in rd {
        let e = e.map_err(|e| StorageError::io("read directory", path, e))?;
        remove_any(&e.path())?;
    }
    Ok(())
}

/// `statvfs(2)` of the file system holding `path`.
fn statvfs(path: &Path) -> Result<libc::statvfs> {
    let c = subvol::cpath(path)?;
    let mut st = MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is NUL-terminated; `st` is writable memory of statvfs's size.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(StorageError::io(
            "statvfs",
            path,
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: statvfs returned 0 and filled the struct.
    Ok(unsafe { st.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_are_found_or_named() {
        match find_tool("definitely-not-a-tool-xyz", "some-package") {
            Err(StorageError::ToolMissing { tool, package }) => {
                assert_eq!(
                    (tool, package),
                    ("definitely-not-a-tool-xyz", "some-package")
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(find_tool("sh", "dash").is_ok());
    }

    #[test]
    fn path_pool_on_non_btrfs_is_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        if subvol::fs_type(d.path()).expect("statfs").0 != ioctl::BTRFS_SUPER_MAGIC {
            let e = Pool::open(&PoolConfig::Path(d.path().into())).expect_err("not btrfs");
            assert!(matches!(e, StorageError::NotBtrfs { .. }), "{e}");
        }
    }

    #[test]
    fn too_small_image_is_refused_before_touching_anything() {
        let d = tempfile::tempdir().expect("tempdir");
        let cfg = PoolConfig::Image {
            image: d.path().join("i.img"),
            size_bytes: 1 << 20,
            mount_point: d.path().join("m"),
        };
        assert!(matches!(
            Pool::open(&cfg),
            Err(StorageError::InvalidArgument { .. })
        ));
        assert!(!d.path().join("i.img").exists());
    }

    #[test]
    fn non_btrfs_image_is_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let img = d.path().join("i.img");
        std::fs::write(&img, vec![0u8; 200_000]).expect("write");
        let cfg = PoolConfig::Image {
            image: img,
            size_bytes: MIN_IMAGE_SIZE,
            mount_point: d.path().join("m"),
        };
        assert!(matches!(
            Pool::open(&cfg),
            Err(StorageError::NotBtrfs { .. })
        ));
    }
}
