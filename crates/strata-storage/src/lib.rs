//! The btrfs storage pool: loop-mounted image, one subvolume per sandbox, read-only
//! snapshot subvolumes, space accounting.
//!
//! ```no_run
//! use strata_storage::{Pool, PoolConfig};
//! # fn main() -> Result<(), strata_storage::StorageError> {
//! let pool = Pool::open(&PoolConfig::Image {
//!     image: "/var/lib/strata/pool.img".into(),
//!     size_bytes: 64 << 30,
//!     mount_point: "/var/lib/strata/pool".into(),
//! })?;
//! let sb = pool.create_subvolume("sandboxes/sb-1")?;
//! pool.snapshot(&sb, "snapshots/sb-1@1", true)?;
//! pool.trash("snapshots/sb-1@1")?;
//! # Ok(()) }
//! ```
//!
//! Hot-path operations are single ioctls (no `btrfs` process). The only external
//! programs are `mkfs.btrfs` (btrfs-progs) when an image is created and `mount`
//! (util-linux) when it is mounted, and `btrfs send` / `btrfs receive` for moves
//! between pools ([`send`]).

pub mod catchup;
mod error;
mod ioctl;
mod mountinfo;
mod pool;
pub mod send;
pub mod subvol;
mod usage;

#[cfg(feature = "testing")]
pub mod testing;

pub use error::{is_device_errno, Result, StorageError};
pub use pool::{
    unmount_image, Pool, PoolConfig, PoolOptions, PoolUsage, ReserveStatus, UsageMethod, LAYOUT,
    MIN_IMAGE_SIZE, MOUNT_OPTIONS, RESERVE_FILE,
};
pub use send::{
    subvol_info, ReceiveSpec, Received, SendStream, StreamSummary, SubvolInfo, TransferError, Uuid,
    IMPORT_DIR,
};
pub use usage::{
    enable_simple_quotas, extent_usage, file_extent_map, kernel_has_simple_quotas, qgroup_usage,
    rewritten_bytes, written_bytes, FileExtent, QuotaStatus, SubvolUsage,
};
