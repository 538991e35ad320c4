//! Guest egress, host side: the tunnels the agent opens (one per guest TCP
//! connection to its egress listener) and how the client serves them.
//!
//! Contract (see `PROTOCOL.md`, *Egress tunnels*):
//!
//! - [`AgentClient::enable_egress`] sends `egress_enable`; the agent answers
//!   with its listener's address. The client does it after every handshake
//!   when given a [`TunnelHandler`].
//! - The agent announces a tunnel with `tunnel_open` on an id with
//!   [`TUNNEL_ID_BIT`](crate::tunnel::TUNNEL_ID_BIT) set. The client asks its
//!   [`TunnelService`] for a byte stream ([`TunnelService::open`], within the
//!   handler's `open_timeout`) and answers `tunnel_ok`, or
//!   `tunnel_close {error}` when it has no handler or the service refuses
//!   (caps, rate, an unreachable target); then both ends run [`run_tunnel`]
//!   (credit windows per direction, half-close with `tunnel_eof`). A refused
//!   tunnel closes that guest connection only; the agent session goes on.
//! - The daemon's service is its egress proxy, served in-process on the
//!   stream (no listener); [`TunnelHandler::tcp`] connects to a TCP address
//!   instead (tests, tools).
//! - An agent that breaks the tunnel rules has that tunnel closed, not the
//!   connection. Frames for a finished tunnel are ignored. When the agent
//!   connection goes away every tunnel's stream is closed.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use strata_core::text::Escaped;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::demux::Shared;
use super::{unexpected, AgentClient, AgentError};
use crate::frame::{Frame, FrameError, FrameKind};
use crate::msg::{Request, Response};
use crate::tunnel::{run_tunnel, tunnel_pair, Delivered, TunnelEnd, TunnelMsg, TunnelOut};

/// Default time the host gives a tunnel's stream to open (the egress
/// target to accept a connection).
pub const EGRESS_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A byte stream one tunnel is pumped into.
pub trait TunnelIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> TunnelIo for T {}

/// The stream of one accepted tunnel.
pub type TunnelStream = Box<dyn TunnelIo>;

/// What [`TunnelService::open`] returns: the stream, or why the tunnel is
/// refused (sent to the agent in `tunnel_close {error}`).
pub type OpenFuture = Pin<Box<dyn Future<Output = Result<TunnelStream, String>> + Send>>;

/// Serves the tunnels the agent opens: one call per `tunnel_open`.
pub trait TunnelService: Send + Sync + 'static {
    /// A stream for a new tunnel from guest address `peer`, or a refusal.
    fn open(&self, peer: &str) -> OpenFuture;
    /// What the tunnels go to, for logs.
    fn describe(&self) -> String;
}

/// How the client serves the tunnels the agent opens (guest egress).
#[derive(Clone)]
pub struct TunnelHandler {
    service: Arc<dyn TunnelService>,
    /// How long [`TunnelService::open`] may take before the tunnel is refused.
    pub open_timeout: Duration,
}

impl std::fmt::Debug for TunnelHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelHandler")
            .field("service", &self.service.describe())
            .field("open_timeout", &self.open_timeout)
            .finish()
    }
}

/// [`TunnelHandler::tcp`]'s service.
struct TcpTarget(SocketAddr);

impl TunnelService for TcpTarget {
    fn open(&self, _peer: &str) -> OpenFuture {
        let target = self.0;
        Box::pin(async move {
            let s = TcpStream::connect(target)
                .await
                .map_err(|e| format!("egress target: {e}"))?;
            let _ = s.set_nodelay(true);
            Ok(Box::new(s) as TunnelStream)
        })
    }
    fn describe(&self) -> String {
        format!("tcp:{}", self.0)
    }
}

impl TunnelHandler {
    /// Tunnels are served by `service`.
    pub fn new(service: Arc<dyn TunnelService>) -> Self {
        Self {
            service,
            open_timeout: EGRESS_CONNECT_TIMEOUT,
        }
    }

    /// Each tunnel becomes a TCP connection to `target` (tests, tools; the
    /// daemon serves its proxy in-process instead).
    pub fn tcp(target: SocketAddr) -> Self {
        Self::new(Arc::new(TcpTarget(target)))
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

    /// Serves this connection's tunnels with `handler` and enables egress
    /// in the guest, for a connection made without one (a warm-pool guest
    /// is connected before it has an owner, so before its egress policy is
    /// known). Refused (`Protocol`) when a handler is bound already: a
    /// guest's egress is never handed to someone else.
    pub async fn bind_egress(&self, handler: TunnelHandler) -> Result<SocketAddr, AgentError> {
        self.inner.egress.set(handler).map_err(|_| {
            AgentError::Protocol(FrameError::Violation(
                "this connection's egress is bound already".into(),
            ))
        })?;
        self.enable_egress().await
    }

    /// Whether this connection's tunnels have a handler (given at connect or
    /// bound since).
    pub fn egress_bound(&self) -> bool {
        self.inner.egress.get().is_some()
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
pub(super) struct HostTunnelOut {
    pub(super) id: u32,
    pub(super) out: mpsc::Sender<Bytes>,
}

impl HostTunnelOut {
    pub(super) async fn send_frame(&self, f: Result<Frame, FrameError>) -> bool {
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
    egress: Option<&TunnelHandler>,
    shared: &Arc<Shared>,
    out: &mpsc::Sender<Bytes>,
    f: Frame,
) -> bool {
    let id = f.id;
    let msg = match f.kind {
        FrameKind::Tunnel => TunnelMsg::Data(f.payload),
        FrameKind::Control => match f.parse::<Response>() {
            Ok(Response::TunnelOpen { peer }) => {
                open_tunnel(egress.cloned(), shared.clone(), out.clone(), id, peer);
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

/// Serves a tunnel the agent opened: open a stream with the service, then pump.
fn open_tunnel(
    egress: Option<TunnelHandler>,
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    id: u32,
    peer: String,
) {
    let Some(handler) = egress else {
        tracing::debug!(id, peer = %Escaped(&peer), "tunnel refused: no egress configured");
        send_tunnel_close(&out, id, "egress is not enabled on this host".into());
        return;
    };
    tokio::spawn(async move {
        let o = HostTunnelOut { id, out };
        let sock = match tokio::time::timeout(handler.open_timeout, handler.service.open(&peer))
            .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(id, %peer, target = %handler.service.describe(), error = %e, "egress tunnel refused");
                o.send(TunnelMsg::Close(Some(e))).await;
                return;
            }
            Err(_) => {
                tracing::warn!(id, target = %handler.service.describe(), "egress target did not accept in time");
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
        tracing::debug!(id, peer = %Escaped(&peer), "tunnel open");
        match run_tunnel(sock, ends, o).await {
            TunnelEnd::Done { sent, received } => {
                tracing::debug!(id, sent, received, "tunnel finished")
            }
            TunnelEnd::Aborted(why) => tracing::debug!(id, %why, "tunnel aborted"),
        }
        shared.tunnels().remove(&id);
    });
}
