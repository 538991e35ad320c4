//! Errors of the VMM layer.

use std::path::PathBuf;

use crate::qmp::QmpError;

/// Everything that can go wrong while starting, driving or adopting a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The QEMU binary is not installed (or not on `PATH`).
    #[error("QEMU binary {binary:?} not found: install it with `apt-get install qemu-system-x86`")]
    QemuNotFound {
        /// The binary that was looked for.
        binary: PathBuf,
    },
    /// The guest kernel file does not exist.
    #[error("guest kernel {path:?} does not exist")]
    KernelMissing {
        /// Path given in the spec.
        path: PathBuf,
    },
    /// The initramfs file does not exist.
    #[error("guest initrd {path:?} does not exist")]
    InitrdMissing {
        /// Path given in the spec.
        path: PathBuf,
    },
    /// The root disk image does not exist.
    #[error("guest disk {path:?} does not exist")]
    DiskMissing {
        /// Path given in the spec.
        path: PathBuf,
    },
    /// The device-state file to restore from does not exist.
    #[error("device state file {path:?} does not exist")]
    StateMissing {
        /// Path given in the spec.
        path: PathBuf,
    },
    /// The spec cannot be turned into a QEMU command line.
    #[error("invalid VM spec: {0}")]
    InvalidSpec(String),
    /// QEMU could not be started, or exited before its QMP socket came up.
    #[error("failed to start QEMU: {reason}")]
    SpawnFailed {
        /// What happened, including the tail of QEMU's stderr when there is one.
        reason: String,
    },
    /// The guest did not reach the expected point in time.
    #[error("guest did not become ready within {secs:.1} s: {what}")]
    BootTimeout {
        /// What was being waited for.
        what: String,
        /// The timeout that expired, in seconds.
        secs: f64,
    },
    /// A QMP command failed.
    #[error("QMP")]
    Qmp(#[from] QmpError),
    /// The QEMU process is gone.
    #[error("QEMU process died: {reason}")]
    ProcessDied {
        /// Why, as far as it is known.
        reason: String,
    },
    /// Saving or loading device state failed.
    #[error("migration failed: {reason}")]
    Migration {
        /// QEMU's error description or the state it got stuck in.
        reason: String,
    },
    /// The VM is not in a state that allows the operation.
    #[error("VM is {status}, operation needs {needed}")]
    WrongState {
        /// The current QEMU run state.
        status: String,
        /// What the operation requires.
        needed: &'static str,
    },
    /// A running QEMU could not be adopted.
    #[error("cannot adopt VM in {run_dir:?}: {reason}")]
    AdoptFailed {
        /// The run directory of the VM.
        run_dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// The VM's cgroup could not be set up and its limits are required.
    #[error("cgroup limits required but not applied")]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// A host I/O operation failed.
    #[error("I/O on {path:?}")]
    Io {
        /// The file or socket concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl VmmError {
    /// Wraps an I/O error with the path it concerns.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        VmmError::Io {
            path: path.into(),
            source,
        }
    }
}
