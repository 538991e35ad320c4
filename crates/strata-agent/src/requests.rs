//! The request table: every in-flight request of the current host session,
//! keyed by its id, with what the session loop needs to feed it.
//!
//! Contract:
//!
//! - The session loop puts a request in the table when it starts one that
//!   outlives its first reply (a command, an upload, a download); the egress
//!   listener puts in each tunnel it opens (agent-chosen ids with
//!   `TUNNEL_ID_BIT` set). Host frames for the id (stdin, file data, acks,
//!   tunnel messages) are routed through the entry; frames for an id not in
//!   the table are late and are dropped.
//! - Each row is tagged with the session epoch that created it. The task
//!   serving the request holds a [`Slot`] and leaves the table when it is
//!   done ([`Slot::release`]), but only if the row is still its own: an
//!   ended session has already cleared the table, and a new session may
//!   have reused the id.
//! - Ending a session clears the table. Dropping an entry is what stops its
//!   request: the upload queue closes (the partial file is removed), the
//!   download's ack channel closes, the stdin pipe closes, the tunnel stops.
//!   Running commands keep running; their output goes to the ended epoch and
//!   is dropped by the transport.
//!
//! This module imports nothing from the modules that serve requests, so they
//! can all use it.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use strata_proto::tunnel::TunnelHandle;
use tokio::sync::{mpsc, oneshot, watch};

use crate::outbox::Outbox;

/// Messages from the session loop to an upload task.
#[derive(Debug)]
pub enum UploadMsg {
    /// File content.
    Data(Bytes),
    /// End of the file.
    End,
}

/// What the host granted a command's output (see `PROTOCOL.md`, *Flow control*).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputCredit {
    /// Cumulative output bytes the host has consumed.
    pub acked: u64,
    /// The host wants no more output: read and drop it.
    pub discard: bool,
}

/// Answer of the host to a tunnel open: `Err(reason)` if it refused.
pub type Opened = oneshot::Sender<Result<(), String>>;

/// One in-flight request.
pub enum Entry {
    /// A running command.
    Exec {
        /// Stdin feed, while open.
        stdin: Option<mpsc::UnboundedSender<Bytes>>,
        /// Its process group.
        pgid: i32,
        /// The host's output credit, when the session windows output.
        output: Option<watch::Sender<OutputCredit>>,
        /// Master side of its pseudo-terminal, if it runs on one.
        pty: Option<Arc<OwnedFd>>,
    },
    /// An upload.
    Upload {
        /// Chunk queue.
        tx: mpsc::Sender<UploadMsg>,
        /// The temporary file it writes (removed at once on `write_abort`).
        tmp: std::path::PathBuf,
    },
    /// A download.
    Download {
        /// Host's consumed-bytes counter.
        acks: watch::Sender<u64>,
    },
    /// A directory watch (`watch.rs`); dropping the row ends it.
    Watch {
        /// Its polls: the longest wait for an event, in milliseconds.
        polls: mpsc::Sender<u64>,
    },
    /// An egress tunnel (agent-chosen id).
    Tunnel {
        /// Where the host's tunnel messages go; dropping it stops the tunnel.
        handle: TunnelHandle,
        /// Waiting for the host to accept or refuse the tunnel.
        opened: Option<Opened>,
    },
}

/// In-flight requests of the current session, keyed by id.
pub type Table = Arc<Mutex<HashMap<u32, (u64, Entry)>>>;

/// Locks the table (a poisoned lock is still usable).
pub fn lock(t: &Table) -> MutexGuard<'_, HashMap<u32, (u64, Entry)>> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// A request's row in the table, held by the task that serves it.
pub struct Slot {
    /// The request id.
    pub id: u32,
    /// Where its replies go (tagged with its session).
    pub out: Outbox,
    table: Table,
    epoch: u64,
}

impl Slot {
    /// The slot of row `id` of session `epoch`, already in `table`.
    pub fn new(table: &Table, id: u32, epoch: u64, out: Outbox) -> Self {
        Self {
            id,
            out,
            table: table.clone(),
            epoch,
        }
    }

    /// Puts `entry` in `table` as row `id` of session `epoch`.
    pub fn insert(table: &Table, id: u32, epoch: u64, out: Outbox, entry: Entry) -> Self {
        lock(table).insert(id, (epoch, entry));
        Self::new(table, id, epoch, out)
    }

    /// Leaves the table: the request is done. Removes the row only if it
    /// still belongs to this slot's session.
    pub fn release(self) {
        let mut g = lock(&self.table);
        if g.get(&self.id).is_some_and(|(e, _)| *e == self.epoch) {
            g.remove(&self.id);
        }
    }
}
