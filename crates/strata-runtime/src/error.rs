//! Errors of the runtime.

use strata_core::ErrorCode;

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
    /// The VM failed.
    #[error("vm of {id} failed: {reason}")]
    VmFailed {
        /// The sandbox.
        id: String,
        /// Why.
        reason: String,
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
    /// The guest agent answered with an error or the channel broke.
    #[error("guest agent of {id}")]
    Agent {
        /// The sandbox.
        id: String,
        /// What the agent said.
        #[source]
        source: strata_proto::client::AgentError,
    },
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

impl RuntimeError {
    /// The stable API code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::SandboxNotFound(_) | RuntimeError::SnapshotNotFound(_) => {
                ErrorCode::NotFound
            }
            RuntimeError::NotRunning { .. } => ErrorCode::InvalidState,
            RuntimeError::SnapshotUnusable { .. } => ErrorCode::SnapshotUnusable,
            RuntimeError::PoolFull => ErrorCode::PoolFull,
            RuntimeError::VmFailed { .. } => ErrorCode::VmFailed,
            RuntimeError::AgentTimeout { .. } => ErrorCode::AgentTimeout,
            RuntimeError::Busy(_) => ErrorCode::Conflict,
            RuntimeError::Invalid(_) => ErrorCode::InvalidRequest,
            RuntimeError::Agent { .. } => ErrorCode::AgentError,
            RuntimeError::Other(_) => ErrorCode::Internal,
        }
    }
}
