//! Test support for other crates (feature `testing`): a real, mounted btrfs pool in a
//! temporary directory. Needs root (mount, loop devices).

use std::ops::Deref;
use std::path::Path;

use crate::{Pool, PoolConfig, Result, StorageError};

/// A mounted image pool under `/tmp/strata-storage-test-*/` that is unmounted, its loop
/// device detached and its directory removed on drop.
#[derive(Debug)]
pub struct TestPool {
    pool: Option<Pool>,
    dir: tempfile::TempDir,
}

impl TestPool {
    /// Creates a sparse image of `size_bytes` (at least [`crate::MIN_IMAGE_SIZE`]),
    /// formats and mounts it.
    pub fn new(size_bytes: u64) -> Result<TestPool> {
        Self::with_options(size_bytes, crate::PoolOptions::default())
    }

    /// Like [`TestPool::new`] with pool options (e.g. quotas on).
    pub fn with_options(size_bytes: u64, options: crate::PoolOptions) -> Result<TestPool> {
        let dir = tempfile::Builder::new()
            .prefix("strata-storage-test-")
            .tempdir_in("/tmp")
            .map_err(|e| StorageError::io("create temp dir", "/tmp", e))?;
        let pool = Pool::open_with(&Self::config_in(dir.path(), size_bytes), options)?;
        Ok(TestPool {
            pool: Some(pool),
            dir,
        })
    }

    /// The `PoolConfig` a test pool in `dir` uses (`dir/pool.img` on `dir/mnt`).
    pub fn config_in(dir: &Path, size_bytes: u64) -> PoolConfig {
        PoolConfig::Image {
            image: dir.join("pool.img"),
            size_bytes,
            mount_point: dir.join("mnt"),
        }
    }

    /// The temporary directory holding the image and the mount point.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The pool (also reachable through `Deref`).
    pub fn pool(&self) -> &Pool {
        self.pool
            .as_ref()
            .unwrap_or_else(|| unreachable!("pool is only taken in drop"))
    }
}

impl Deref for TestPool {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        self.pool()
    }
}

impl Drop for TestPool {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            if let Err(e) = p.unmount() {
                eprintln!(
                    "TestPool: unmount of {} failed: {e}",
                    self.dir.path().display()
                );
            }
        }
    }
}
