//! Egress tunnels: byte streams the agent opens (one per guest TCP
//! connection to its egress listener) and the host connects to its egress
//! target. Both ends run the same pump, [`run_tunnel`], between a byte
//! stream (the guest's TCP socket in the agent; on the host whatever the
//! [`crate::TunnelHandler`] gives, e.g. an in-process duplex to the egress
//! proxy) and the agent channel.
//!
//! Flow control is a credit window per direction: a side never has more than
//! [`TUNNEL_WINDOW`] bytes sent and not yet acknowledged; the receiver
//! acknowledges (cumulatively) what it has written to its socket, at least
//! every [`TUNNEL_ACK_EVERY`] bytes. So each stream holds at most one window
//! of data per direction in memory, and a slow socket on one side stalls only
//! its own stream. A receiver that gets more than a window beyond its last
//! acknowledgement aborts the stream.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Unacknowledged bytes a side may have in flight per stream and direction.
pub const TUNNEL_WINDOW: u64 = 512 * 1024;
/// Largest payload of one tunnel data frame.
pub const TUNNEL_CHUNK: usize = 64 * 1024;
/// A receiver acknowledges at least every this many written bytes.
pub const TUNNEL_ACK_EVERY: u64 = TUNNEL_WINDOW / 4;
/// Bit set in every tunnel id (agent-chosen), clear in every host request id.
pub const TUNNEL_ID_BIT: u32 = 0x8000_0000;

/// Bit set (with [`TUNNEL_ID_BIT`]) in the id of every port tunnel: those
/// are host-chosen ([`crate::msg::Request::PortConnect`]); the agent keeps it
/// clear in the egress tunnels it opens.
pub const PORT_ID_BIT: u32 = 0x4000_0000;

/// Whether `id` names a tunnel (as opposed to a host request).
pub fn is_tunnel_id(id: u32) -> bool {
    id & TUNNEL_ID_BIT != 0
}

/// Whether `id` names a host-opened port tunnel.
pub fn is_port_id(id: u32) -> bool {
    id & (TUNNEL_ID_BIT | PORT_ID_BIT) == TUNNEL_ID_BIT | PORT_ID_BIT
}

/// One tunnel message, in either direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TunnelMsg {
    /// Stream bytes (a [`crate::frame::FrameKind::Tunnel`] frame).
    Data(Bytes),
    /// Cumulative bytes the sender of this message has written out.
    Ack(u64),
    /// No more data from the sender of this message (half-close).
    Eof,
    /// The stream is aborted (with a reason if it failed).
    Close(Option<String>),
}

/// How a pump sends its messages to the other end of the agent channel.
pub trait TunnelOut: Send + Sync + 'static {
    /// Sends one message; `false` if the channel is gone.
    fn send(&self, msg: TunnelMsg) -> impl Future<Output = bool> + Send;
}

/// What the router should do with a stream after [`TunnelHandle::deliver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivered {
    /// Keep routing to it.
    Keep,
    /// The peer closed it: forget it (dropping the handle stops the pump).
    Remove,
    /// The peer broke the rules: forget it and send `Close` with this reason.
    Abort(String),
}

enum Inbound {
    Data(Bytes),
    Eof,
}

/// The router's end of one stream: where messages from the peer go.
/// Dropping it stops the pump (sockets closed, no further messages).
#[derive(Debug)]
pub struct TunnelHandle {
    acks: watch::Sender<u64>,
    inbound: mpsc::UnboundedSender<Inbound>,
    received: u64,
    peer_eof: bool,
    acked: Arc<AtomicU64>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Inbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Data(b) => write!(f, "Data({} bytes)", b.len()),
            Self::Eof => f.write_str("Eof"),
        }
    }
}

/// The pump's end of one stream (see [`run_tunnel`]).
#[derive(Debug)]
pub struct TunnelEnds {
    acks: watch::Receiver<u64>,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    acked: Arc<AtomicU64>,
    cancel: CancellationToken,
}

/// A connected handle (for the router) and ends (for the pump).
pub fn tunnel_pair() -> (TunnelHandle, TunnelEnds) {
    let (acks_tx, acks_rx) = watch::channel(0u64);
    let (in_tx, in_rx) = mpsc::unbounded_channel();
    let acked = Arc::new(AtomicU64::new(0));
    let cancel = CancellationToken::new();
    (
        TunnelHandle {
            acks: acks_tx,
            inbound: in_tx,
            received: 0,
            peer_eof: false,
            acked: acked.clone(),
            cancel: cancel.clone(),
        },
        TunnelEnds {
            acks: acks_rx,
            inbound: in_rx,
            acked,
            cancel,
        },
    )
}

impl TunnelHandle {
    /// Routes one message from the peer to the pump.
    pub fn deliver(&mut self, msg: TunnelMsg) -> Delivered {
        match msg {
            TunnelMsg::Data(b) => {
                if self.peer_eof {
                    return Delivered::Abort("tunnel data after eof".into());
                }
                self.received += b.len() as u64;
                let acked = self.acked.load(Ordering::SeqCst);
                if self.received.saturating_sub(acked) > TUNNEL_WINDOW {
                    return Delivered::Abort("tunnel window exceeded".into());
                }
                // A closed pump (finished or failed) simply drops late data.
                let _ = self.inbound.send(Inbound::Data(b));
                Delivered::Keep
            }
            TunnelMsg::Ack(n) => {
                self.acks.send_if_modified(|cur| {
                    let newer = n > *cur;
                    if newer {
                        *cur = n;
                    }
                    newer
                });
                Delivered::Keep
            }
            TunnelMsg::Eof => {
                self.peer_eof = true;
                let _ = self.inbound.send(Inbound::Eof);
                Delivered::Keep
            }
            TunnelMsg::Close(_) => Delivered::Remove,
        }
    }
}

impl Drop for TunnelHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// How a tunnel ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TunnelEnd {
    /// Both directions finished with end-of-file.
    Done {
        /// Bytes read from the socket and sent to the peer.
        sent: u64,
        /// Bytes received from the peer and written to the socket.
        received: u64,
    },
    /// Aborted: by the peer, by the session ending, or by a local socket
    /// error (then `Close` with the error was sent to the peer).
    Aborted(String),
}

enum Stop {
    /// Local failure: tell the peer.
    Fail(String),
    /// The agent channel (or the peer) is gone: nothing to tell.
    Gone,
}

/// Pumps bytes between `sock` and the peer until both directions reached
/// end-of-file, the stream is aborted, or its handle is dropped. A TCP
/// socket should have `TCP_NODELAY` set by the caller.
pub async fn run_tunnel<S, O>(sock: S, ends: TunnelEnds, out: O) -> TunnelEnd
where
    S: AsyncRead + AsyncWrite + Send,
    O: TunnelOut,
{
    let (mut rd, mut wr) = tokio::io::split(sock);
    let TunnelEnds {
        mut acks,
        mut inbound,
        acked,
        cancel,
    } = ends;
    let out = &out;
    let up = async {
        let mut sent: u64 = 0;
        loop {
            let room = loop {
                let peer_acked = *acks.borrow_and_update();
                let in_flight = sent.saturating_sub(peer_acked);
                if in_flight < TUNNEL_WINDOW {
                    break (TUNNEL_WINDOW - in_flight).min(TUNNEL_CHUNK as u64) as usize;
                }
                if acks.changed().await.is_err() {
                    return Err(Stop::Gone);
                }
            };
            let mut buf = vec![0u8; room];
            let n = rd
                .read(&mut buf)
                .await
                .map_err(|e| Stop::Fail(format!("read: {e}")))?;
            if n == 0 {
                return if out.send(TunnelMsg::Eof).await {
                    Ok(sent)
                } else {
                    Err(Stop::Gone)
                };
            }
            buf.truncate(n);
            sent += n as u64;
            if !out.send(TunnelMsg::Data(buf.into())).await {
                return Err(Stop::Gone);
            }
        }
    };
    let down = async {
        let mut written: u64 = 0;
        let mut acked_sent: u64 = 0;
        loop {
            match inbound.recv().await {
                Some(Inbound::Data(b)) => {
                    wr.write_all(&b)
                        .await
                        .map_err(|e| Stop::Fail(format!("write: {e}")))?;
                    written += b.len() as u64;
                    if written - acked_sent >= TUNNEL_ACK_EVERY {
                        // Recorded before sending: the peer may use the credit at once.
                        acked.store(written, Ordering::SeqCst);
                        acked_sent = written;
                        if !out.send(TunnelMsg::Ack(written)).await {
                            return Err(Stop::Gone);
                        }
                    }
                }
                Some(Inbound::Eof) => {
                    // The peer may already have closed; nothing to report then.
                    let _ = wr.shutdown().await;
                    return Ok(written);
                }
                None => return Err(Stop::Gone),
            }
        }
    };
    let result = tokio::select! {
        _ = cancel.cancelled() => return TunnelEnd::Aborted("closed".into()),
        r = async { tokio::try_join!(up, down) } => r,
    };
    match result {
        Ok((sent, received)) => TunnelEnd::Done { sent, received },
        Err(Stop::Gone) => TunnelEnd::Aborted("agent channel closed".into()),
        Err(Stop::Fail(e)) => {
            out.send(TunnelMsg::Close(Some(e.clone()))).await;
            TunnelEnd::Aborted(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(is_tunnel_id(TUNNEL_ID_BIT | 5));
        assert!(!is_tunnel_id(5));
        assert!(is_port_id(TUNNEL_ID_BIT | PORT_ID_BIT | 5));
        assert!(!is_port_id(TUNNEL_ID_BIT | 5));
        assert!(!is_port_id(PORT_ID_BIT | 5));
    }

    #[test]
    fn window_is_enforced_and_acks_extend_it() {
        let (mut h, _ends) = tunnel_pair();
        let chunk = Bytes::from(vec![0u8; TUNNEL_CHUNK]);
        let per_window = (TUNNEL_WINDOW as usize) / TUNNEL_CHUNK;
        for _ in 0..per_window {
            assert_eq!(h.deliver(TunnelMsg::Data(chunk.clone())), Delivered::Keep);
        }
        // The pump acknowledged one chunk: exactly one more fits.
        h.acked.store(TUNNEL_CHUNK as u64, Ordering::SeqCst);
        assert_eq!(h.deliver(TunnelMsg::Data(chunk.clone())), Delivered::Keep);
        assert!(matches!(
            h.deliver(TunnelMsg::Data(Bytes::from_static(b"x"))),
            Delivered::Abort(_)
        ));
    }

    #[test]
    fn data_after_eof_and_close() {
        let (mut h, _ends) = tunnel_pair();
        assert_eq!(h.deliver(TunnelMsg::Eof), Delivered::Keep);
        assert!(matches!(
            h.deliver(TunnelMsg::Data(Bytes::from_static(b"x"))),
            Delivered::Abort(_)
        ));
        assert_eq!(h.deliver(TunnelMsg::Close(None)), Delivered::Remove);
    }

    #[test]
    fn dropping_the_handle_cancels() {
        let (h, ends) = tunnel_pair();
        assert!(!ends.cancel.is_cancelled());
        drop(h);
        assert!(ends.cancel.is_cancelled());
    }
}
