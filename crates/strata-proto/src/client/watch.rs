//! Directory watches, host side: inotify events of a guest directory
//! ([`AgentClient::watch_dir`]).
//!
//! Contract (see `PROTOCOL.md`, *Directory watches*):
//!
//! - `watch {path, recursive}` opens the watch on a fresh id; the agent
//!   answers `watch_started {dirs}` or `error` (`not_found`,
//!   `not_a_directory`, `other` for its caps). An agent that predates the
//!   op answers `invalid_argument` with `bad request: …`: that is
//!   [`AgentError::Unsupported`] here, and the caller keeps whatever it did
//!   before (the E2B door lists and diffs).
//! - The host polls on the watch's id ([`DirWatch::poll`]): one
//!   `watch_events {events, more}` per `watch_poll`, at most
//!   [`crate::msg::MAX_WATCH_BATCH`] events in one frame. The agent holds the
//!   events between polls (a bounded buffer, an `overflow` event when it
//!   fills); the host holds at most the answer it asked for, so nothing a
//!   guest sends grows host memory past one reply (and the call's
//!   [`super::CALL_BUFFER_CAP`] bounds an agent that answers unasked).
//! - Dropping the [`DirWatch`] sends `watch_stop` (the agent closes the
//!   inotify instance); a lost connection (the sandbox paused, stopped, its
//!   agent restarted) ends it too: polls then fail with
//!   [`AgentError::Closed`].

use std::time::Duration;

use super::demux::{send_detached, Call};
use super::{remote, unexpected, AgentClient, AgentError};
use crate::msg::{RemoteErrorKind, Request, Response, WatchEvent, MAX_WATCH_WAIT_MS};

/// How much longer than the wait it asked for a poll waits for its answer
/// before it fails with [`AgentError::Timeout`] (and ends the watch).
pub const WATCH_POLL_GRACE: Duration = Duration::from_secs(15);

/// How long the agent has to start a watch (a recursive one adds a watch
/// per directory).
pub const WATCH_START_TIMEOUT: Duration = Duration::from_secs(60);

/// One answer to [`DirWatch::poll`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchBatch {
    /// Events, oldest first.
    pub events: Vec<WatchEvent>,
    /// The agent holds more: poll again.
    pub more: bool,
}

/// A live inotify watch of a guest directory. Dropping it ends the watch.
pub struct DirWatch {
    client: AgentClient,
    call: Call,
    dirs: u32,
    broken: bool,
}

impl std::fmt::Debug for DirWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatch")
            .field("id", &self.call.id)
            .field("dirs", &self.dirs)
            .field("broken", &self.broken)
            .finish()
    }
}

impl DirWatch {
    /// Directories the agent watches for this watch (at its start).
    pub fn dirs(&self) -> u32 {
        self.dirs
    }

    /// Whether the watch is over: its connection is gone (the sandbox
    /// paused, stopped, its agent restarted) or a poll failed.
    pub fn is_closed(&self) -> bool {
        self.broken || self.client.is_closed()
    }

    /// The events the agent buffered since the last poll. With `wait` and
    /// none buffered, the agent answers at the first event or after `wait`
    /// (capped at [`MAX_WATCH_WAIT_MS`]). The agent drains the kernel's
    /// queue before it answers, so a poll sent after a file operation
    /// returned includes that operation's events.
    pub async fn poll(&mut self, wait: Duration) -> Result<WatchBatch, AgentError> {
        if self.broken {
            return Err(AgentError::Closed);
        }
        let wait_ms = (wait.as_millis() as u64).min(MAX_WATCH_WAIT_MS);
        self.client
            .send_req(self.call.id, &Request::WatchPoll { wait_ms })
            .await?;
        let limit = Duration::from_millis(wait_ms) + WATCH_POLL_GRACE;
        let r = match tokio::time::timeout(limit, self.call.recv_msg()).await {
            Ok(r) => r,
            Err(_) => {
                self.broken = true;
                return Err(AgentError::Timeout);
            }
        };
        match r {
            Ok(Response::WatchEvents { events, more }) => Ok(WatchBatch { events, more }),
            Ok(Response::Error { kind, message }) => {
                self.broken = true;
                Err(remote(kind, message))
            }
            Ok(r) => {
                self.broken = true;
                Err(unexpected(&r))
            }
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        send_detached(&self.client.inner.out, self.call.id, &Request::WatchStop {});
    }
}

impl AgentClient {
    /// Starts an inotify watch of guest directory `path` (and, with
    /// `recursive`, of the tree below it). An agent that predates watches
    /// answers [`AgentError::Unsupported`]; see the module docs.
    pub async fn watch_dir(&self, path: &str, recursive: bool) -> Result<DirWatch, AgentError> {
        let mut call = self.inner.shared.open()?;
        let req = Request::Watch {
            path: path.to_owned(),
            recursive,
        };
        self.send_req(call.id, &req).await?;
        let r = tokio::time::timeout(WATCH_START_TIMEOUT, call.recv_msg())
            .await
            .map_err(|_| AgentError::Timeout)??;
        match r {
            Response::WatchStarted { dirs } => Ok(DirWatch {
                client: self.clone(),
                call,
                dirs,
                broken: false,
            }),
            Response::Error {
                kind: RemoteErrorKind::InvalidArgument,
                message,
            } if message.starts_with("bad request") => Err(AgentError::Unsupported {
                feature: "directory watches",
            }),
            Response::Error { kind, message } => Err(remote(kind, message)),
            r => Err(unexpected(&r)),
        }
    }
}
