//! Errors of the runtime.
//!
//! Contract:
//! - Every failed [`crate::Runtime`] operation answers one [`RuntimeError`]
//!   and leaves the sandbox as it was (running if it was running).
//! - A cause from a layer below stays typed behind `#[source]`: the VMM
//!   driver's [`VmmError`] in [`RuntimeError::Vmm`], the pool's
//!   [`StorageError`] in [`RuntimeError::Storage`], host I/O in
//!   [`RuntimeError::Io`], a broken agent channel's [`AgentError`] in
//!   [`RuntimeError::Agent`]. Running out of pool space, whichever layer
//!   noticed it, is [`RuntimeError::PoolFull`].
//! - A failure the guest agent reports (no such file, exists, permission...)
//!   is [`RuntimeError::Guest`], its [`GuestErrorKind`] taken from the agent
//!   protocol's error code ([`RemoteErrorKind`]), never from its text.
//! - A message never repeats its `#[source]` (Cloud Hypervisor's rule): the
//!   top level prints the chain once, e.g. with [`chain`].
//! - [`RuntimeError::code`] is the one place a runtime error becomes a stable
//!   API [`ErrorCode`].

use strata_core::ErrorCode;
use strata_proto::{AgentError, RemoteErrorKind};
use strata_storage::StorageError;
use strata_vmm::VmmError;

/// Why a runtime operation failed. A failed operation leaves the sandbox as
/// it was (running if it was running).
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No live VM / subvolume for this sandbox on this host.
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    /// No such snapshot or template.
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// The operation needs a running (or paused) VM.
    #[error("sandbox {id} is not running")]
    NotRunning {
        /// The sandbox.
        id: String,
    },
    /// A snapshot is missing a part or was written by an incompatible host.
    #[error("snapshot {id} is unusable: {reason}")]
    SnapshotUnusable {
        /// The snapshot or template id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The pool is full.
    #[error("storage pool is full")]
    PoolFull,
    /// The VMM driver failed: QEMU would not start or restore, a QMP
    /// command failed, the device state could not be saved.
    #[error("vm of {id} failed")]
    Vmm {
        /// The sandbox (or template build).
        id: String,
        /// What the driver reported.
        #[source]
        source: VmmError,
    },
    /// A VM failure known only as text. This runtime reports VM failures as
    /// [`RuntimeError::Vmm`] and no longer produces this variant; it stays
    /// for the callers that match on it.
    #[error("vm of {id} failed: {reason}")]
    VmFailed {
        /// The sandbox.
        id: String,
        /// Why.
        reason: String,
    },
    /// The btrfs pool failed (other than by running full: [`RuntimeError::PoolFull`]).
    #[error("storage")]
    Storage(#[source] StorageError),
    /// Host I/O on the runtime's files or programs failed (other than by
    /// running out of space: [`RuntimeError::PoolFull`]).
    #[error("{what}")]
    Io {
        /// What was being done, e.g. `write meta.json`.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The guest agent did not answer.
    #[error("agent of {id} did not answer within {timeout_ms} ms")]
    AgentTimeout {
        /// The sandbox.
        id: String,
        /// The timeout that expired.
        timeout_ms: u64,
    },
    /// Another operation holds this sandbox.
    #[error("another operation is in progress on {0}")]
    Busy(String),
    /// The request cannot be satisfied as asked (bad size, wrong owner, exists).
    #[error("{0}")]
    Invalid(String),
    /// The guest agent ran the request and reports a failure of this kind.
    #[error("guest of {id}: {kind}: {message}")]
    Guest {
        /// The sandbox.
        id: String,
        /// The category, from the agent protocol's error code.
        kind: GuestErrorKind,
        /// The agent's detail (a path, a program, an errno text).
        message: String,
    },
    /// The channel to the guest agent failed (closed, i/o, protocol,
    /// version), or it did not answer in a deadline the caller set.
    #[error("guest agent of {id}")]
    Agent {
        /// The sandbox.
        id: String,
        /// What went wrong on the channel.
        #[source]
        source: AgentError,
    },
    /// No runtime is behind the caller's engine (a daemon built or started
    /// without one); this runtime never produces it.
    #[error("{0}")]
    Unavailable(String),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

/// Category of a failure the guest agent reports ([`RuntimeError::Guest`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GuestErrorKind {
    /// No such path, user or program in the guest.
    NotFound,
    /// The target already exists.
    Exists,
    /// EACCES / EPERM in the guest.
    PermissionDenied,
    /// The request is not valid (relative path, NUL byte, bad value).
    Invalid,
    /// A non-directory where a directory was expected.
    NotADirectory,
    /// A directory where a file was expected.
    IsADirectory,
    /// The guest's disk is full (ENOSPC / EDQUOT).
    NoSpace,
    /// Anything else: the command could not be started, the agent could not
    /// read the request, an error without a category.
    Other,
}

impl From<RemoteErrorKind> for GuestErrorKind {
    fn from(k: RemoteErrorKind) -> Self {
        match k {
            RemoteErrorKind::NotFound => Self::NotFound,
            RemoteErrorKind::AlreadyExists => Self::Exists,
            RemoteErrorKind::PermissionDenied => Self::PermissionDenied,
            RemoteErrorKind::InvalidArgument => Self::Invalid,
            RemoteErrorKind::NotADirectory => Self::NotADirectory,
            RemoteErrorKind::IsADirectory => Self::IsADirectory,
            RemoteErrorKind::NoSpace => Self::NoSpace,
            RemoteErrorKind::SpawnFailed | RemoteErrorKind::Protocol | RemoteErrorKind::Other => {
                Self::Other
            }
        }
    }
}

impl std::fmt::Display for GuestErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotFound => "not found",
            Self::Exists => "already exists",
            Self::PermissionDenied => "permission denied",
            Self::Invalid => "invalid argument",
            Self::NotADirectory => "not a directory",
            Self::IsADirectory => "is a directory",
            Self::NoSpace => "no space left",
            Self::Other => "failed",
        })
    }
}

impl GuestErrorKind {
    /// The stable API code: a missing path is `not_found`, an invalid
    /// request `invalid_request`, every other guest failure `agent_error`
    /// (the /v1 answers as the daemon has given them so far).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::NotFound => ErrorCode::NotFound,
            Self::Invalid => ErrorCode::InvalidRequest,
            Self::Exists
            | Self::PermissionDenied
            | Self::NotADirectory
            | Self::IsADirectory
            | Self::NoSpace
            | Self::Other => ErrorCode::AgentError,
        }
    }
}

impl RuntimeError {
    /// The stable API code for this error; every variant maps here, once.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::SandboxNotFound(_) | RuntimeError::SnapshotNotFound(_) => {
                ErrorCode::NotFound
            }
            RuntimeError::NotRunning { .. } => ErrorCode::InvalidState,
            RuntimeError::SnapshotUnusable { .. } => ErrorCode::SnapshotUnusable,
            RuntimeError::PoolFull => ErrorCode::PoolFull,
            RuntimeError::Vmm { .. } | RuntimeError::VmFailed { .. } => ErrorCode::VmFailed,
            RuntimeError::Storage(e) if e.is_device_failure() => ErrorCode::StorageFailed,
            RuntimeError::Io { source, .. } if strata_storage::is_device_errno(source) => {
                ErrorCode::StorageFailed
            }
            RuntimeError::Storage(_) | RuntimeError::Io { .. } => ErrorCode::Internal,
            RuntimeError::AgentTimeout { .. } => ErrorCode::AgentTimeout,
            RuntimeError::Busy(_) => ErrorCode::Conflict,
            RuntimeError::Invalid(_) => ErrorCode::InvalidRequest,
            RuntimeError::Guest { kind, .. } => kind.code(),
            RuntimeError::Agent { .. } => ErrorCode::AgentError,
            RuntimeError::Unavailable(_) | RuntimeError::Other(_) => ErrorCode::Internal,
        }
    }

    /// The whole message: this error and its sources, each once.
    pub fn message(&self) -> String {
        chain(self)
    }

    /// An error of sandbox `id`'s agent client, kept typed: a failure the
    /// agent reports becomes [`RuntimeError::Guest`] (its kind from the
    /// protocol's error code), anything else [`RuntimeError::Agent`].
    /// For callers that use the [`strata_proto::AgentClient`] of
    /// [`crate::Runtime::agent`] directly.
    pub fn from_agent(id: &str, e: AgentError) -> RuntimeError {
        match e {
            AgentError::Remote { kind, message } => RuntimeError::Guest {
                id: id.to_owned(),
                kind: kind.into(),
                message,
            },
            source => RuntimeError::Agent {
                id: id.to_owned(),
                source,
            },
        }
    }
}

/// `e` and its sources joined by `: `, each message once.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        msg.push_str(": ");
        msg.push_str(&cause.to_string());
        src = cause.source();
    }
    msg
}

/// A pool error: running full is [`RuntimeError::PoolFull`].
pub(crate) fn storage_err(e: StorageError) -> RuntimeError {
    if e.is_no_space() {
        RuntimeError::PoolFull
    } else {
        RuntimeError::Storage(e)
    }
}

/// A VMM driver error of sandbox (or build) `id`.
pub(crate) fn vmm_err(id: &str, source: VmmError) -> RuntimeError {
    RuntimeError::Vmm {
        id: id.to_owned(),
        source,
    }
}

/// A host I/O error while doing `what`: ENOSPC is [`RuntimeError::PoolFull`].
pub(crate) fn io_err(what: impl Into<String>, source: std::io::Error) -> RuntimeError {
    if source.raw_os_error() == Some(libc::ENOSPC) {
        RuntimeError::PoolFull
    } else {
        RuntimeError::Io {
            what: what.into(),
            source,
        }
    }
}

/// An agent error of a call the runtime made with deadline `timeout`: a
/// missed deadline is [`RuntimeError::AgentTimeout`], the rest as
/// [`RuntimeError::from_agent`].
pub(crate) fn agent_err(id: &str, e: AgentError, timeout: std::time::Duration) -> RuntimeError {
    match e {
        AgentError::ConnectTimeout(_) | AgentError::Timeout => RuntimeError::AgentTimeout {
            id: id.to_owned(),
            timeout_ms: timeout.as_millis() as u64,
        },
        other => RuntimeError::from_agent(id, other),
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;
    use std::time::Duration;

    use super::*;

    fn remote(kind: RemoteErrorKind) -> AgentError {
        AgentError::Remote {
            kind,
            message: "/tmp/x".into(),
        }
    }

    #[test]
    fn guest_kind_comes_from_the_protocol_code_not_the_text() {
        // The text says "exists"; the code says not found: the code wins.
        let e = RuntimeError::from_agent(
            "sb-a",
            AgentError::Remote {
                kind: RemoteErrorKind::NotFound,
                message: "file exists".into(),
            },
        );
        assert!(matches!(
            e,
            RuntimeError::Guest {
                kind: GuestErrorKind::NotFound,
                ..
            }
        ));
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(e.to_string(), "guest of sb-a: not found: file exists");
    }

    #[test]
    fn guest_codes_match_the_daemons_answers() {
        let code = |k| RuntimeError::from_agent("sb-a", remote(k)).code();
        assert_eq!(code(RemoteErrorKind::NotFound), ErrorCode::NotFound);
        assert_eq!(
            code(RemoteErrorKind::InvalidArgument),
            ErrorCode::InvalidRequest
        );
        for k in [
            RemoteErrorKind::AlreadyExists,
            RemoteErrorKind::PermissionDenied,
            RemoteErrorKind::NoSpace,
            RemoteErrorKind::IsADirectory,
            RemoteErrorKind::NotADirectory,
            RemoteErrorKind::SpawnFailed,
            RemoteErrorKind::Protocol,
            RemoteErrorKind::Other,
        ] {
            assert_eq!(code(k), ErrorCode::AgentError, "{k:?}");
        }
        assert_eq!(
            GuestErrorKind::from(RemoteErrorKind::AlreadyExists),
            GuestErrorKind::Exists
        );
    }

    #[test]
    fn channel_failures_and_timeouts() {
        let closed = RuntimeError::from_agent("sb-a", AgentError::Closed);
        assert!(matches!(closed, RuntimeError::Agent { .. }));
        assert_eq!(closed.code(), ErrorCode::AgentError);
        assert_eq!(
            closed.message(),
            "guest agent of sb-a: agent connection closed"
        );
        let t = agent_err("sb-a", AgentError::Timeout, Duration::from_secs(2));
        assert!(matches!(
            t,
            RuntimeError::AgentTimeout {
                timeout_ms: 2000,
                ..
            }
        ));
        assert_eq!(t.code(), ErrorCode::AgentTimeout);
        let g = agent_err("sb-a", remote(RemoteErrorKind::NotFound), Duration::ZERO);
        assert!(matches!(g, RuntimeError::Guest { .. }));
    }

    #[test]
    fn sources_stay_typed_and_are_printed_once() {
        let e = vmm_err(
            "sb-a",
            VmmError::ProcessDied {
                reason: "killed".into(),
            },
        );
        assert!(matches!(
            e.source().and_then(|s| s.downcast_ref::<VmmError>()),
            Some(VmmError::ProcessDied { .. })
        ));
        assert_eq!(e.to_string(), "vm of sb-a failed");
        assert_eq!(e.message(), "vm of sb-a failed: QEMU process died: killed");
        assert_eq!(e.code(), ErrorCode::VmFailed);

        let io = io_err(
            "write meta.json",
            std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert!(matches!(io, RuntimeError::Io { .. }));
        assert!(
            io.message().starts_with("write meta.json: "),
            "{}",
            io.message()
        );
        assert_eq!(io.code(), ErrorCode::Internal);
    }

    #[test]
    fn no_space_is_pool_full_from_any_layer() {
        let e = io_err("grow disk", std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(matches!(e, RuntimeError::PoolFull));
        let s = storage_err(StorageError::NoSpace {
            op: "snapshot",
            path: "/pool/x".into(),
        });
        assert!(matches!(s, RuntimeError::PoolFull));
        assert_eq!(s.code(), ErrorCode::PoolFull);
        let other = storage_err(StorageError::NotFound {
            path: "/pool/x".into(),
        });
        assert!(matches!(other, RuntimeError::Storage(_)));
        assert_eq!(other.message(), "storage: /pool/x does not exist");
    }

    #[test]
    fn every_variant_has_its_code() {
        let cases = [
            (
                RuntimeError::SandboxNotFound("a".into()),
                ErrorCode::NotFound,
            ),
            (
                RuntimeError::SnapshotNotFound("a".into()),
                ErrorCode::NotFound,
            ),
            (
                RuntimeError::NotRunning { id: "a".into() },
                ErrorCode::InvalidState,
            ),
            (
                RuntimeError::SnapshotUnusable {
                    id: "a".into(),
                    reason: "r".into(),
                },
                ErrorCode::SnapshotUnusable,
            ),
            (RuntimeError::PoolFull, ErrorCode::PoolFull),
            (
                RuntimeError::Io {
                    what: "write".into(),
                    source: std::io::Error::from_raw_os_error(libc::EROFS),
                },
                ErrorCode::StorageFailed,
            ),
            (
                RuntimeError::Io {
                    what: "write".into(),
                    source: std::io::Error::from_raw_os_error(libc::EPERM),
                },
                ErrorCode::Internal,
            ),
            (
                RuntimeError::VmFailed {
                    id: "a".into(),
                    reason: "r".into(),
                },
                ErrorCode::VmFailed,
            ),
            (
                RuntimeError::AgentTimeout {
                    id: "a".into(),
                    timeout_ms: 1,
                },
                ErrorCode::AgentTimeout,
            ),
            (RuntimeError::Busy("a".into()), ErrorCode::Conflict),
            (RuntimeError::Invalid("a".into()), ErrorCode::InvalidRequest),
            (RuntimeError::Unavailable("a".into()), ErrorCode::Internal),
            (RuntimeError::Other("a".into()), ErrorCode::Internal),
        ];
        for (e, code) in cases {
            assert_eq!(e.code(), code, "{e}");
        }
    }
}
