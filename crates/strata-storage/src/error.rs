//! The one error type of the storage pool.

use std::io;
use std::path::PathBuf;

/// What went wrong in a storage pool operation.
///
/// Every operation that returns an error leaves the pool as it was: no half-created
/// subvolume, snapshot or file is left behind.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The pool path is not on btrfs.
    #[error(
        "{path} is on a {fs_type} file system, not btrfs: use the image pool mode \
         (PoolConfig::Image, a btrfs image file strata creates and loop-mounts) \
         or mount a btrfs file system there"
    )]
    NotBtrfs {
        /// The path that was checked.
        path: PathBuf,
        /// Name of the file system found there (e.g. `ext2/ext3/ext4`, `tmpfs`).
        fs_type: String,
    },
    /// A path that must exist does not.
    #[error("{path} does not exist")]
    NotFound {
        /// The missing path.
        path: PathBuf,
    },
    /// A path that must not exist does.
    #[error("{path} already exists")]
    AlreadyExists {
        /// The existing path.
        path: PathBuf,
    },
    /// ENOSPC from the file system.
    #[error("storage pool is full ({op} {path})")]
    NoSpace {
        /// The operation that ran out of space.
        op: &'static str,
        /// The path it was working on.
        path: PathBuf,
    },
    /// A path that must be a btrfs subvolume is a plain directory or file.
    #[error("{path} is not a btrfs subvolume")]
    NotASubvolume {
        /// The path.
        path: PathBuf,
    },
    /// A path given to a pool operation lies outside the pool.
    #[error("{path} is outside the storage pool at {root}")]
    OutsidePool {
        /// The offending path.
        path: PathBuf,
        /// The pool root.
        root: PathBuf,
    },
    /// A path or size argument is not usable.
    #[error("invalid argument {what}: {reason}")]
    InvalidArgument {
        /// The argument.
        what: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A program strata needs is not installed.
    #[error("`{tool}` is not installed: install the `{package}` package")]
    ToolMissing {
        /// The program.
        tool: &'static str,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// Mounting the pool image failed.
    #[error("mounting {source_path} at {mount_point} failed: {reason}")]
    MountFailed {
        /// What was mounted (the image file or loop device).
        source_path: PathBuf,
        /// Where.
        mount_point: PathBuf,
        /// The mount program's message.
        reason: String,
    },
    /// Something other than this pool's image is mounted at the mount point.
    #[error(
        "{mount_point} already has {found} mounted on it, not the pool image {image}: \
         unmount it or choose another mount point"
    )]
    MountPointBusy {
        /// The mount point.
        mount_point: PathBuf,
        /// Description of what is mounted there (type and source).
        found: String,
        /// The pool image that should have been there.
        image: PathBuf,
    },
    /// An external program failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// Quota groups were asked for but are not enabled on the pool.
    #[error("btrfs quotas are not enabled on the pool at {root}")]
    QuotasDisabled {
        /// The pool root.
        root: PathBuf,
    },
    /// Any other I/O error.
    #[error("{op} {path}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path it was working on.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl StorageError {
    /// Maps an OS error of `op` on `path` to the matching variant (ENOSPC → `NoSpace`, ...).
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StorageError::NoSpace { op, path },
            Some(libc::ENOENT) => StorageError::NotFound { path },
            Some(libc::EEXIST) => StorageError::AlreadyExists { path },
            _ => StorageError::Io { op, path, source },
        }
    }

    /// True for the `NoSpace` variant.
    pub fn is_no_space(&self) -> bool {
        matches!(self, StorageError::NoSpace { .. })
    }

    /// True when the file system refused because its device failed: an
    /// I/O error (EIO), or the pool is read-only (EROFS; btrfs turns
    /// read-only by itself after a write error).
    pub fn is_device_failure(&self) -> bool {
        matches!(self, StorageError::Io { source, .. } if is_device_errno(source))
    }
}

/// EIO or EROFS: the device failed or the file system went read-only.
pub fn is_device_errno(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EIO) | Some(libc::EROFS))
}

/// Result alias of this crate.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_maps_to_no_space_with_clear_message() {
        let e = StorageError::io(
            "snapshot",
            "/p/x",
            io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert!(e.is_no_space());
        assert!(e.to_string().starts_with("storage pool is full"), "{e}");
    }

    #[test]
    fn other_errnos_map() {
        let e = StorageError::io("open", "/p/x", io::Error::from_raw_os_error(libc::ENOENT));
        assert!(matches!(e, StorageError::NotFound { .. }));
        let e = StorageError::io("open", "/p/x", io::Error::from_raw_os_error(libc::EEXIST));
        assert!(matches!(e, StorageError::AlreadyExists { .. }));
        let e = StorageError::io("open", "/p/x", io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(e, StorageError::Io { .. }));
        assert!(e.is_device_failure());
        let e = StorageError::io("open", "/p/x", io::Error::from_raw_os_error(libc::EROFS));
        assert!(e.is_device_failure());
        let e = StorageError::io("open", "/p/x", io::Error::from_raw_os_error(libc::EPERM));
        assert!(!e.is_device_failure());
    }

    #[test]
    fn not_btrfs_message_tells_what_to_do() {
        let e = StorageError::NotBtrfs {
            path: "/tmp".into(),
            fs_type: "ext2/ext3/ext4".into(),
        };
        let m = e.to_string();
        assert!(
            m.contains("image pool mode") && m.contains("mount a btrfs"),
            "{m}"
        );
    }
}
