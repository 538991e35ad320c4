//! Guest ports, host side: byte streams to `127.0.0.1:<port>` inside the
//! guest, carried over the agent channel (no guest network needed).
//!
//! Contract (see `PROTOCOL.md`, *Port tunnels*):
//!
//! - [`AgentClient::connect_port`] picks a tunnel id with
//!   [`TUNNEL_ID_BIT`] and [`PORT_ID_BIT`] set, registers the tunnel's handle
//!   and sends `port_connect {port}` on it. The agent connects in the guest
//!   and answers `port_connected`; from then on both ends run the egress
//!   tunnels' pump ([`run_tunnel`]: a credit window of
//!   [`crate::tunnel::TUNNEL_WINDOW`] per direction, half-close, abort).
//! - The agent answers `error`: `not_found` when nothing listens
//!   ([`PortError::Refused`]); an older agent answers `invalid_argument` to
//!   the unknown op ([`PortError::Unsupported`]: this sandbox's agent cannot
//!   forward ports). No answer within [`PORT_CONNECT_TIMEOUT`]: the tunnel is
//!   closed on both ends ([`PortError::Timeout`]).
//! - At most [`PORT_TUNNELS_MAX`] port tunnels are open per connection (one
//!   connection per sandbox); one more is refused before anything is sent
//!   ([`PortError::TooMany`]).
//! - The caller gets a [`PortStream`] (an in-process duplex of
//!   [`PORT_STREAM_BUFFER`] bytes per direction to the pump). Dropping it ends
//!   the tunnel (half-close, then close); it counts the bytes each way.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use strata_core::text::Escaped;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::{mpsc, oneshot};

use super::demux::Shared;
use super::tunnel::HostTunnelOut;
use super::{AgentClient, AgentError};
use crate::frame::{Frame, FrameKind};
use crate::msg::{RemoteErrorKind, Request, Response};
use crate::tunnel::{
    run_tunnel, tunnel_pair, TunnelEnd, TunnelMsg, TunnelOut, PORT_ID_BIT, TUNNEL_ID_BIT,
};

/// Most port tunnels open at once on one agent connection (one sandbox).
pub const PORT_TUNNELS_MAX: usize = 256;
/// How long the agent has to connect to the guest port and answer.
pub const PORT_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// Bytes the in-process stream between a [`PortStream`] and its pump holds
/// per direction (besides the tunnel's window).
pub const PORT_STREAM_BUFFER: usize = 64 * 1024;

/// Why a port tunnel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// This sandbox's agent predates port tunnels.
    #[error("this sandbox's agent cannot forward ports (an older agent)")]
    Unsupported,
    /// Nothing accepted the connection on the guest port.
    #[error("nothing accepts connections on guest port {port}: {}", Escaped(.message))]
    Refused {
        /// The guest port.
        port: u16,
        /// The agent's detail.
        message: String,
    },
    /// The port is not valid (0).
    #[error("invalid guest port {0}")]
    InvalidPort(u16),
    /// [`PORT_TUNNELS_MAX`] port tunnels are open already.
    #[error("too many open port connections to this sandbox (at most {max})")]
    TooMany {
        /// The cap.
        max: usize,
    },
    /// The agent did not answer within [`PORT_CONNECT_TIMEOUT`].
    #[error("the guest did not connect to port {port} in time")]
    Timeout {
        /// The guest port.
        port: u16,
    },
    /// The agent reported another failure.
    #[error("guest port {port}: {kind}: {}", Escaped(.message))]
    Guest {
        /// The guest port.
        port: u16,
        /// Category.
        kind: RemoteErrorKind,
        /// Detail.
        message: String,
    },
    /// The agent channel failed.
    #[error("agent channel")]
    Agent(#[from] AgentError),
}

type Answer = Result<(), (RemoteErrorKind, String)>;

/// The port tunnels of one connection: those waiting for their answer, the
/// open count, the id counter.
#[derive(Default)]
pub(super) struct Ports {
    pending: Mutex<HashMap<u32, oneshot::Sender<Answer>>>,
    next: AtomicU32,
    open: Arc<AtomicUsize>,
}

impl Ports {
    /// Port tunnels open or being opened.
    pub(super) fn open_count(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u32, oneshot::Sender<Answer>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Holds one of the [`PORT_TUNNELS_MAX`] places until dropped.
struct Place(Arc<AtomicUsize>);

impl Place {
    fn take(open: &Arc<AtomicUsize>) -> Option<Self> {
        let mut cur = open.load(Ordering::SeqCst);
        loop {
            if cur >= PORT_TUNNELS_MAX {
                return None;
            }
            match open.compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(Place(open.clone())),
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Bytes a [`PortStream`] carried.
#[derive(Debug, Default)]
pub struct PortCounters {
    /// Written by the host (towards the guest port).
    pub to_guest: AtomicU64,
    /// Read by the host (from the guest port).
    pub from_guest: AtomicU64,
}

/// An open connection to a guest port ([`AgentClient::connect_port`]).
/// Dropping it (or shutting down its write side) ends the tunnel.
#[derive(Debug)]
pub struct PortStream {
    io: DuplexStream,
    counters: Arc<PortCounters>,
    port: u16,
}

impl PortStream {
    /// The guest port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The byte counts, live (they outlive the stream).
    pub fn counters(&self) -> Arc<PortCounters> {
        self.counters.clone()
    }
}

impl AsyncRead for PortStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before) as u64;
        if n > 0 {
            self.counters.from_guest.fetch_add(n, Ordering::Relaxed);
        }
        r
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.counters
                .to_guest
                .fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl AgentClient {
    /// Connects to `127.0.0.1:<port>` inside the guest over the agent
    /// channel (see the module docs for the rules and errors).
    pub async fn connect_port(&self, port: u16) -> Result<PortStream, PortError> {
        if port == 0 {
            return Err(PortError::InvalidPort(port));
        }
        let ports = &self.inner.ports;
        let shared = &self.inner.shared;
        let place = Place::take(&ports.open).ok_or(PortError::TooMany {
            max: PORT_TUNNELS_MAX,
        })?;
        let (handle, ends) = tunnel_pair();
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut tunnels = shared.tunnels();
            if shared.is_closed() {
                return Err(AgentError::Closed.into());
            }
            let mut pending = ports.pending();
            let id = loop {
                let n = ports.next.fetch_add(1, Ordering::Relaxed) & !(TUNNEL_ID_BIT | PORT_ID_BIT);
                let id = TUNNEL_ID_BIT | PORT_ID_BIT | n;
                if !tunnels.contains_key(&id) && !pending.contains_key(&id) {
                    break id;
                }
            };
            tunnels.insert(id, handle);
            pending.insert(id, tx);
            id
        };
        let out = HostTunnelOut {
            id,
            out: self.inner.out.clone(),
        };
        let forget = || {
            shared.tunnels().remove(&id);
            ports.pending().remove(&id);
        };
        if !out
            .send_frame(Frame::control(id, &Request::PortConnect { port }))
            .await
        {
            forget();
            return Err(AgentError::Closed.into());
        }
        let answer = match tokio::time::timeout(PORT_CONNECT_TIMEOUT, rx).await {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => {
                forget();
                return Err(AgentError::Closed.into());
            }
            Err(_) => {
                forget();
                out.send(TunnelMsg::Close(Some("port connect timed out".into())))
                    .await;
                return Err(PortError::Timeout { port });
            }
        };
        if let Err((kind, message)) = answer {
            shared.tunnels().remove(&id);
            return Err(match kind {
                RemoteErrorKind::InvalidArgument => PortError::Unsupported,
                RemoteErrorKind::NotFound => PortError::Refused { port, message },
                kind => PortError::Guest {
                    port,
                    kind,
                    message,
                },
            });
        }
        let (mine, pump_side) = tokio::io::duplex(PORT_STREAM_BUFFER);
        let shared = shared.clone();
        tokio::spawn(async move {
            let _place = place;
            match run_tunnel(pump_side, ends, out).await {
                TunnelEnd::Done { sent, received } => {
                    tracing::debug!(id, port, sent, received, "port tunnel finished")
                }
                TunnelEnd::Aborted(why) => tracing::debug!(id, port, %why, "port tunnel aborted"),
            }
            shared.tunnels().remove(&id);
        });
        Ok(PortStream {
            io: mine,
            counters: Arc::new(PortCounters::default()),
            port,
        })
    }

    /// Port tunnels open on this connection.
    pub fn open_ports(&self) -> usize {
        self.inner.ports.open.load(Ordering::SeqCst)
    }
}

/// Routes one frame on a port tunnel's id: the agent's answer to
/// `port_connect` resolves the waiting opener; the rest is tunnel traffic
/// (routed as egress tunnels' is). `false` if the connection must close.
pub(super) fn route(
    ports: &Ports,
    shared: &Arc<Shared>,
    out: &mpsc::Sender<Bytes>,
    f: Frame,
) -> bool {
    if f.kind == FrameKind::Control {
        let answer = match f.parse::<Response>() {
            Ok(Response::PortConnected {}) => Some(Ok(())),
            Ok(Response::Error { kind, message }) => Some(Err((kind, message))),
            Ok(Response::TunnelOpen { .. }) => {
                // Port ids are the host's: an agent must not open one.
                tracing::debug!(id = f.id, "agent opened a tunnel on a port id; refused");
                let o = HostTunnelOut {
                    id: f.id,
                    out: out.clone(),
                };
                tokio::spawn(async move {
                    o.send(TunnelMsg::Close(Some("not an egress tunnel id".into())))
                        .await
                });
                return true;
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable control message from agent");
                return false;
            }
        };
        if let Some(a) = answer {
            let waiting = ports.pending().remove(&f.id);
            match waiting {
                Some(tx) => {
                    let _ = tx.send(a);
                }
                None if a.is_err() => {
                    // An error after the answer: the tunnel is over.
                    shared.tunnels().remove(&f.id);
                }
                None => {}
            }
            return true;
        }
    }
    super::tunnel::route(None, shared, out, f)
}
