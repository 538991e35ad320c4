//! Guest egress, host side: the tunnels the agent opens (one per guest TCP
//! connection to its egress listener) and how the client serves them.
//!
//! Contract (see `PROTOCOL.md`, *Egress tunnels*):
//!
//! - [`AgentClient::enable_egress`] sends `egress_enable`; the agent answers
//!   with its listener's address. The client does it after every handshake
//!   when given a [`TunnelHandler`].
//! - The agent announces a tunnel with `tunnel_open` on an id with
//!   [`TUNNEL_ID_BIT`](crate::tunnel::TUNNEL_ID_BIT) set. The client connects
//!   to [`TunnelHandler::target`] within its `connect_timeout` and answers
//!   `tunnel_ok`, or `tunnel_close {error}` when it has no handler or the
//!   target refuses; then both ends run [`run_tunnel`] (credit windows per
//!   direction, half-close with `tunnel_eof`).
//! - An agent that breaks the tunnel rules has that tunnel closed, not the
//!   connection. Frames for a finished tunnel are ignored. When the agent
//!   connection goes away every tunnel's target connection is closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::demux::Shared;
use super::{unexpected, AgentClient, AgentError};
use crate::frame::{Frame, FrameError, FrameKind};
use crate::msg::{Request, Response};
use crate::tunnel::{run_tunnel, tunnel_pair, Delivered, TunnelEnd, TunnelMsg, TunnelOut};

/// Default time the host gives the egress target to accept a tunnel's connection.
pub const EGRESS_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How the client serves the tunnels the agent opens (guest egress): each
/// becomes a TCP connection to `target` (the daemon's egress proxy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelHandler {
    /// Where every tunnel is connected to.
    pub target: SocketAddr,
    /// How long a connect to `target` may take before the tunnel is refused.
    pub connect_timeout: Duration,
}

impl TunnelHandler {
    /// Tunnels go to the TCP address `target`.
    pub fn tcp(target: SocketAddr) -> Self {
        Self {
            target,
            connect_timeout: EGRESS_CONNECT_TIMEOUT,
        }
    }
}

impl AgentClient {
    /// Asks the agent to forward guest connections to its egress listener
    /// (this session only; the client does it on connect when given a
    /// [`TunnelHandler`]). Returns the listener's address in the guest.
    /// Tunnels opened while the client has no handler are refused.
    pub async fn enable_egress(&self) -> Result<SocketAddr, AgentError> {
        match self.call(&Request::EgressEnable {}).await? {
            Response::EgressEnabled { listen } => {
                let addr: SocketAddr = listen.parse().map_err(|_| {
                    AgentError::Protocol(FrameError::Violation(format!(
                        "bad egress listen address {listen:?}"
                    )))
                })?;
                let _ = self.inner.egress_listen.set(addr);
                Ok(addr)
            }
            r => Err(unexpected(&r)),
        }
    }

    /// The guest's egress listener, once egress is enabled on this connection.
    pub fn egress_listen(&self) -> Option<SocketAddr> {
        self.inner.egress_listen.get().copied()
    }

    /// Tunnels currently open on this connection.
    pub fn open_tunnels(&self) -> usize {
        self.inner.shared.tunnels().len()
    }
}

/// Sends a tunnel's messages to the agent.
struct HostTunnelOut {
    id: u32,
    out: mpsc::Sender<Bytes>,
}

impl HostTunnelOut {
    async fn send_frame(&self, f: Result<Frame, FrameError>) -> bool {
        match f.and_then(|f| f.encode()) {
            Ok(b) => self.out.send(b).await.is_ok(),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode tunnel frame");
                false
            }
        }
    }
}

impl TunnelOut for HostTunnelOut {
    async fn send(&self, msg: TunnelMsg) -> bool {
        let f = match msg {
            TunnelMsg::Data(b) => Ok(Frame::data(FrameKind::Tunnel, self.id, b)),
            TunnelMsg::Ack(bytes) => Frame::control(self.id, &Request::TunnelAck { bytes }),
            TunnelMsg::Eof => Frame::control(self.id, &Request::TunnelEof {}),
            TunnelMsg::Close(error) => Frame::control(self.id, &Request::TunnelClose { error }),
        };
        self.send_frame(f).await
    }
}

/// Tells the agent tunnel `id` is closed, without blocking the reader.
fn send_tunnel_close(out: &mpsc::Sender<Bytes>, id: u32, error: String) {
    let o = HostTunnelOut {
        id,
        out: out.clone(),
    };
    tokio::spawn(async move { o.send(TunnelMsg::Close(Some(error))).await });
}

/// Routes one frame of an agent-opened tunnel, serving new tunnels with
/// `egress` (`None`: refused); `false` if the connection must close.
pub(super) fn route(
    egress: Option<TunnelHandler>,
    shared: &Arc<Shared>,
    out: &mpsc::Sender<Bytes>,
    f: Frame,
) -> bool {
    let id = f.id;
    let msg = match f.kind {
        FrameKind::Tunnel => TunnelMsg::Data(f.payload),
        FrameKind::Control => match f.parse::<Response>() {
            Ok(Response::TunnelOpen { peer }) => {
                open_tunnel(egress, shared.clone(), out.clone(), id, peer);
                return true;
            }
            Ok(Response::TunnelAck { bytes }) => TunnelMsg::Ack(bytes),
            Ok(Response::TunnelEof {}) => TunnelMsg::Eof,
            Ok(Response::TunnelClose { error }) => TunnelMsg::Close(error),
            Ok(r) => {
                tracing::debug!(id, reply = ?r, "unexpected message on a tunnel id");
                return true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "undecodable control message from agent");
                return false;
            }
        },
        k => {
            tracing::debug!(id, kind = ?k, "unexpected frame kind on a tunnel id");
            return true;
        }
    };
    let mut tunnels = shared.tunnels();
    let Some(h) = tunnels.get_mut(&id) else {
        return true; // late frame of a finished tunnel
    };
    match h.deliver(msg) {
        Delivered::Keep => {}
        Delivered::Remove => {
            tunnels.remove(&id);
        }
        Delivered::Abort(why) => {
            tracing::warn!(id, %why, "agent broke tunnel rules; closing the tunnel");
            tunnels.remove(&id);
            send_tunnel_close(out, id, why);
        }
    }
    true
}

/// Serves a tunnel the agent opened: connect to the egress target, then pump.
fn open_tunnel(
    egress: Option<TunnelHandler>,
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    id: u32,
    peer: String,
) {
    let Some(handler) = egress else {
        tracing::debug!(id, %peer, "tunnel refused: no egress configured");
        send_tunnel_close(&out, id, "egress is not enabled on this host".into());
        return;
    };
    tokio::spawn(async move {
        let o = HostTunnelOut { id, out };
        let sock = match tokio::time::timeout(
            handler.connect_timeout,
            TcpStream::connect(handler.target),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!(id, target = %handler.target, error = %e, "egress target refused a tunnel");
                o.send(TunnelMsg::Close(Some(format!("egress target: {e}"))))
                    .await;
                return;
            }
            Err(_) => {
                tracing::warn!(id, target = %handler.target, "egress target did not accept in time");
                o.send(TunnelMsg::Close(Some("egress target timed out".into())))
                    .await;
                return;
            }
        };
        let (handle, ends) = tunnel_pair();
        {
            let mut tunnels = shared.tunnels();
            if shared.is_closed() {
                return;
            }
            tunnels.insert(id, handle);
        }
        if !o
            .send_frame(Frame::control(id, &Request::TunnelOk {}))
            .await
        {
            shared.tunnels().remove(&id);
            return;
        }
        tracing::debug!(id, %peer, target = %handler.target, "tunnel open");
        match run_tunnel(sock, ends, o).await {
            TunnelEnd::Done { sent, received } => {
                tracing::debug!(id, sent, received, "tunnel finished")
            }
            TunnelEnd::Aborted(why) => tracing::debug!(id, %why, "tunnel aborted"),
        }
        shared.tunnels().remove(&id);
    });
}
