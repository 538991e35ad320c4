//! The error of a failed request, as the host sees it: a category it can
//! act on ([`RemoteErrorKind`]) and a message, sent as `error {kind, message}`
//! on the request's id.

use strata_proto::RemoteErrorKind;

/// A failed request: category and message for the host.
#[derive(Debug, Clone)]
pub struct Fail {
    /// Category.
    pub kind: RemoteErrorKind,
    /// Message.
    pub message: String,
}

impl Fail {
    /// New failure.
    pub fn new(kind: RemoteErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// From an I/O error about `what`.
    pub fn io(e: &std::io::Error, what: &str) -> Self {
        Self::new(RemoteErrorKind::from_io(e), format!("{what}: {e}"))
    }
}
