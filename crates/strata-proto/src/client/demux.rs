//! The connection under an [`AgentClient`]: one reader task, one writer
//! task, and the table that routes incoming frames to their request.
//!
//! Contract (see `PROTOCOL.md`, *Frames*):
//!
//! - Every request the client starts registers a [`Call`] under a fresh id
//!   (non-zero, [`TUNNEL_ID_BIT`] clear); every frame the agent sends with that
//!   id, control message or data, reaches that call in order. Dropping the
//!   call unregisters the id; later frames for it are dropped.
//! - Id 0 is connection-level: a `hello_ok` there is a repeated handshake
//!   answer (ignored), an `error` is a protocol error and closes the
//!   connection.
//! - Ids with [`TUNNEL_ID_BIT`] set belong to tunnels the agent opens; they go
//!   to the [`TunnelRouter`] given at [`spawn`] (`super::tunnel`, which sits
//!   on top of this module: this one knows nothing of tunnels but their ids
//!   and their table).
//! - A malformed frame or an undecodable control message closes the
//!   connection; so does a failed read or write. Closing fails every
//!   in-flight call with [`AgentError::Closed`] and stops every tunnel.
//!
//! [`AgentClient`]: super::AgentClient

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::AgentError;
use crate::frame::{Decoded, Frame, FrameDecoder, FrameKind};
use crate::msg::Response;
use crate::tunnel::{is_tunnel_id, TunnelHandle, TUNNEL_ID_BIT};

/// One frame for a request, as its [`Call`] receives it.
pub(super) enum Incoming {
    /// A control message.
    Msg(Response),
    /// A data frame of this kind.
    Data(FrameKind, Bytes),
}

/// State shared by the client handles, the reader and the writer.
pub(super) struct Shared {
    routes: Mutex<HashMap<u32, mpsc::UnboundedSender<Incoming>>>,
    tunnels: Mutex<HashMap<u32, TunnelHandle>>,
    closed: AtomicBool,
    next_id: AtomicU32,
}

impl Shared {
    fn routes(&self) -> MutexGuard<'_, HashMap<u32, mpsc::UnboundedSender<Incoming>>> {
        // A poisoned lock only means another task panicked mid-insert; the map is still usable.
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open tunnels, by id.
    pub(super) fn tunnels(&self) -> MutexGuard<'_, HashMap<u32, TunnelHandle>> {
        self.tunnels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the connection is gone.
    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Marks the connection gone: in-flight calls fail, tunnels stop.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.routes().clear();
        // Dropping the handles stops their pumps (sockets closed).
        let tunnels = std::mem::take(&mut *self.tunnels());
        drop(tunnels);
    }

    /// Registers a new request id.
    pub(super) fn open(self: &Arc<Self>) -> Result<Call, AgentError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut routes = self.routes();
        if self.is_closed() {
            return Err(AgentError::Closed);
        }
        let id = loop {
            // Host ids keep the high bit clear: those ids belong to the agent's tunnels.
            let id = self.next_id.fetch_add(1, Ordering::Relaxed) & !TUNNEL_ID_BIT;
            if id != 0 && !routes.contains_key(&id) {
                break id;
            }
        };
        routes.insert(id, tx);
        Ok(Call {
            id,
            rx,
            shared: self.clone(),
        })
    }
}

/// A registered request id; unregisters on drop.
pub(super) struct Call {
    /// The request id.
    pub(super) id: u32,
    /// Its frames, in arrival order.
    pub(super) rx: mpsc::UnboundedReceiver<Incoming>,
    shared: Arc<Shared>,
}

impl Drop for Call {
    fn drop(&mut self) {
        self.shared.routes().remove(&self.id);
    }
}

impl Call {
    /// Next frame; `Closed` once the connection is gone.
    pub(super) async fn recv(&mut self) -> Result<Incoming, AgentError> {
        self.rx.recv().await.ok_or(AgentError::Closed)
    }

    /// Next control message, ignoring data frames.
    pub(super) async fn recv_msg(&mut self) -> Result<Response, AgentError> {
        loop {
            if let Incoming::Msg(m) = self.recv().await? {
                return Ok(m);
            }
        }
    }
}

/// Where the reader hands a frame of a tunnel id; `false` if the connection
/// must close.
pub(super) type TunnelRouter =
    Box<dyn Fn(&Arc<Shared>, &mpsc::Sender<Bytes>, Frame) -> bool + Send + Sync>;

/// The running connection: what [`spawn`] hands back.
pub(super) struct Connection {
    /// State shared with the tasks.
    pub(super) shared: Arc<Shared>,
    /// Encoded frames for the writer task.
    pub(super) out: mpsc::Sender<Bytes>,
    /// The reader task (aborted when the last client handle goes).
    pub(super) reader: JoinHandle<()>,
}

/// Starts the reader and writer tasks on a connection whose handshake is
/// done; `dec` holds what was read past the hello reply.
pub(super) fn spawn(stream: UnixStream, dec: FrameDecoder, tunnels: TunnelRouter) -> Connection {
    let (rd, wr) = stream.into_split();
    let shared = Arc::new(Shared {
        routes: Mutex::new(HashMap::new()),
        tunnels: Mutex::new(HashMap::new()),
        closed: AtomicBool::new(false),
        next_id: AtomicU32::new(1),
    });
    let (out, out_rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(writer_task(wr, out_rx, shared.clone()));
    let reader = tokio::spawn(reader_task(rd, dec, shared.clone(), out.clone(), tunnels));
    Connection {
        shared,
        out,
        reader,
    }
}

async fn writer_task(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut rx: mpsc::Receiver<Bytes>,
    shared: Arc<Shared>,
) {
    while let Some(b) = rx.recv().await {
        if let Err(e) = wr.write_all(&b).await {
            tracing::debug!(error = %e, "agent connection write failed");
            shared.close();
            return;
        }
    }
    let _ = wr.shutdown().await;
}

async fn reader_task(
    mut rd: tokio::net::unix::OwnedReadHalf,
    mut dec: FrameDecoder,
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    tunnels: TunnelRouter,
) {
    let mut buf = vec![0u8; 256 * 1024];
    'outer: loop {
        loop {
            match dec.next_item() {
                Ok(None) => break,
                Ok(Some(Decoded::Sync)) => {}
                Ok(Some(Decoded::Frame(f))) => {
                    if !route(&shared, &out, &tunnels, f) {
                        break 'outer;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "malformed frame from agent; closing connection");
                    break 'outer;
                }
            }
        }
        match rd.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => dec.extend(&buf[..n]),
            Err(e) => {
                tracing::debug!(error = %e, "agent connection read failed");
                break;
            }
        }
    }
    shared.close();
}

/// Routes one frame; `false` if the connection must close.
fn route(
    shared: &Arc<Shared>,
    out: &mpsc::Sender<Bytes>,
    tunnels: &TunnelRouter,
    f: Frame,
) -> bool {
    if is_tunnel_id(f.id) {
        return tunnels(shared, out, f);
    }
    let inc = if f.kind == FrameKind::Control {
        match f.parse::<Response>() {
            Ok(r) => Incoming::Msg(r),
            Err(e) => {
                tracing::warn!(error = %e, "undecodable control message from agent");
                return false;
            }
        }
    } else {
        Incoming::Data(f.kind, f.payload)
    };
    if f.id == 0 {
        return match inc {
            Incoming::Msg(Response::HelloOk { .. }) => true,
            Incoming::Msg(Response::Error { kind, message }) => {
                tracing::warn!(%kind, %message, "agent reported a connection-level error");
                false
            }
            _ => true,
        };
    }
    if let Some(tx) = shared.routes().get(&f.id) {
        let _ = tx.send(inc);
    }
    true
}
