//! The error type of image building and loading.

use std::path::PathBuf;

/// Why an image could not be built or loaded.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A host tool the builder calls is not installed.
    #[error("required tool `{tool}` not found on the host; install the Debian package `{package}` (apt-get install {package})")]
    MissingTool {
        /// The command or file that is missing.
        tool: String,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// The guest agent binary named by the recipe does not exist.
    #[error("guest agent binary {path} not found; build it first with `cargo build --release -p strata-agent`")]
    MissingAgent {
        /// The path from the recipe.
        path: PathBuf,
    },
    /// The recipe is not usable as given.
    #[error("invalid image recipe: {0}")]
    InvalidRecipe(String),
    /// The kernel version could not be resolved from the metapackage.
    #[error("cannot resolve the kernel version from `{metapackage}`: {reason}")]
    KernelResolve {
        /// The metapackage asked (e.g. `linux-image-amd64`).
        metapackage: String,
        /// What went wrong.
        reason: String,
    },
    /// A package could not be downloaded.
    #[error("download of Debian package `{package}` failed: {detail}")]
    Download {
        /// The package name.
        package: String,
        /// The tail of apt-get's output.
        detail: String,
    },
    /// A kernel module named in the recipe is not in the kernel package.
    #[error("kernel module `{module}` not found in kernel {kernel_version} (not in modules.dep)")]
    ModuleNotFound {
        /// The module name from the recipe.
        module: String,
        /// The resolved kernel version.
        kernel_version: String,
    },
    /// A file expected inside the kernel package is missing.
    #[error("kernel package content missing: {0}")]
    KernelContent(String),
    /// An external command exited unsuccessfully.
    #[error("`{command}` failed ({status}): {output_tail}")]
    CommandFailed {
        /// The command line, shortened.
        command: String,
        /// Exit status description.
        status: String,
        /// The last lines of its output.
        output_tail: String,
    },
    /// An external command could not be started.
    #[error("cannot run `{command}`")]
    Spawn {
        /// The program name.
        command: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file system operation failed.
    #[error("{what} {path}")]
    Io {
        /// What was attempted (e.g. "cannot write").
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An image directory is incomplete or its manifest is unreadable.
    #[error("image at {dir} is not a complete strata image: {reason}")]
    NotAnImage {
        /// The directory that was loaded.
        dir: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The manifest could not be encoded or decoded.
    #[error("manifest {path} is malformed")]
    Manifest {
        /// The manifest path.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

impl ImageError {
    /// Builds an [`ImageError::Io`] from a path and an `io::Error`.
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| ImageError::Io { what, path, source }
    }
}
