//! Directory watches of a guest (inotify in the guest agent):
//! [`Service::watch_dir`], for front doors that report file-system events
//! (the E2B door's envd watchers).
//!
//! Gated as a listing: the call runs under a grant whose read covers the
//! watched directory (the front door decides `file_read` on the decoded
//! path, for the caller's tenancy) and wakes the sandbox as any guest file
//! operation does. The returned watch is then polled without the service:
//! it ends when dropped, or when the sandbox stops running (its agent
//! connection goes away: the next poll fails).

use super::prelude::*;
use crate::engine::{AgentError, DirWatch};

impl Service {
    /// Starts watching guest directory `path` (with `recursive`, the tree
    /// below it) under `g`. An engine or agent without watches answers an
    /// error that [`watch_unsupported`] recognises.
    pub async fn watch_dir(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        recursive: bool,
    ) -> ServiceResult<DirWatch> {
        let id = self.guest_ready(g, GuestOp::List, path).await?;
        Ok(self.engine.watch_dir(&id, path, recursive).await?)
    }
}

/// Whether `e` says the sandbox cannot watch directories (an engine without
/// watches, or an agent older than them): the caller lists and diffs instead.
pub fn watch_unsupported(e: &ServiceError) -> bool {
    matches!(
        e,
        ServiceError::Engine(RuntimeError::Unavailable(_))
            | ServiceError::Engine(RuntimeError::Agent {
                source: AgentError::Unsupported { .. },
                ..
            })
    )
}
