//! Build progress reported to the caller.

use std::fmt;
use std::time::Duration;

/// A build step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Checking inputs and resolving the kernel version.
    Resolve,
    /// A complete image with this hash exists: nothing to build.
    CacheHit,
    /// Downloading and unpacking the kernel package.
    Kernel,
    /// Writing the initramfs.
    Initramfs,
    /// Creating the debootstrap tree (or taking it from the cache).
    Debootstrap,
    /// Copying the tree and adding the agent, users and config files.
    RootFs,
    /// Writing the ext4 image.
    Filesystem,
    /// Writing the manifest and moving the image into the cache.
    Finish,
    /// The image is ready.
    Done,
}

impl Step {
    /// A short lowercase name for logs.
    pub fn name(self) -> &'static str {
        match self {
            Step::Resolve => "resolve",
            Step::CacheHit => "cache-hit",
            Step::Kernel => "kernel",
            Step::Initramfs => "initramfs",
            Step::Debootstrap => "debootstrap",
            Step::RootFs => "rootfs",
            Step::Filesystem => "mkfs",
            Step::Finish => "finish",
            Step::Done => "done",
        }
    }
}

/// One progress event: the step, what is happening, and the time since the
/// build started.
#[derive(Debug, Clone)]
pub struct Progress {
    /// The current step.
    pub step: Step,
    /// A human-readable detail (a tool's output line, a size, a path).
    pub detail: String,
    /// Time since `build` was called.
    pub elapsed: Duration,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{:>6.1}s] {:<11} {}",
            self.elapsed.as_secs_f64(),
            self.step.name(),
            self.detail
        )
    }
}
