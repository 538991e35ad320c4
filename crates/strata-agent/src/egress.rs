//! Guest egress: a TCP listener (default `127.0.0.1:3128`) whose accepted
//! connections become tunnels over the agent channel; the host hands each
//! one to its egress proxy (in-process, or a TCP target in tests), or refuses
//! it (`tunnel_close {error}`: caps, rate), and the guest connection is then
//! closed while the session goes on.
//!
//! The listener is bound on the first `egress_enable` and stays bound for the
//! agent's life (it survives host disconnects and snapshot restores). Egress
//! itself is per session: a connection is forwarded only while the current
//! host session has enabled it; otherwise (no host, or a host that did not
//! ask) the guest connection is closed at once.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_proto::frame::FrameKind;
use strata_proto::tunnel::{
    run_tunnel, tunnel_pair, TunnelEnd, TunnelMsg, TunnelOut, PORT_ID_BIT, TUNNEL_ID_BIT,
};
use strata_proto::Response;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::{lock, Entry, Slot, Table};
use crate::transport::Outgoing;

/// How long a new tunnel waits for the host to accept or refuse it.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Egress state of the agent (one per process).
pub struct Egress {
    listen: SocketAddr,
    bound: Mutex<Option<SocketAddr>>,
    /// Session epoch that enabled egress (0: none; epochs start at 1).
    enabled_epoch: AtomicU64,
    next_id: AtomicU32,
}

/// What the accept loop needs of the session loop.
pub struct Ctx {
    /// Outgoing frames.
    pub out: mpsc::Sender<Outgoing>,
    /// Current session epoch.
    pub epoch: Arc<AtomicU64>,
    /// Request/tunnel table.
    pub table: Table,
}

impl Egress {
    /// Egress that will listen on `listen` once enabled.
    pub fn new(listen: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            listen,
            bound: Mutex::new(None),
            enabled_epoch: AtomicU64::new(0),
            next_id: AtomicU32::new(1),
        })
    }

    /// Whether session `epoch` has enabled egress.
    pub fn enabled(&self, epoch: u64) -> bool {
        self.enabled_epoch.load(Ordering::SeqCst) == epoch
    }

    /// The proxy URL commands of session `epoch` get, if egress is on.
    pub fn proxy_url(&self, epoch: u64) -> Option<String> {
        if !self.enabled(epoch) {
            return None;
        }
        let bound = *self.bound.lock().unwrap_or_else(|p| p.into_inner());
        bound.map(|a| format!("http://{a}"))
    }

    /// Enables egress for session `epoch`, binding the listener if needed.
    pub fn enable(self: &Arc<Self>, epoch: u64, ctx: Ctx) -> Result<SocketAddr, Fail> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        let addr = match *bound {
            Some(a) => a,
            None => {
                let std_l = std::net::TcpListener::bind(self.listen)
                    .map_err(|e| Fail::io(&e, &format!("egress listen on {}", self.listen)))?;
                std_l
                    .set_nonblocking(true)
                    .map_err(|e| Fail::io(&e, "egress listener"))?;
                let l =
                    TcpListener::from_std(std_l).map_err(|e| Fail::io(&e, "egress listener"))?;
                let a = l
                    .local_addr()
                    .map_err(|e| Fail::io(&e, "egress listener"))?;
                tracing::info!(listen = %a, "egress listener bound");
                tokio::spawn(self.clone().accept_loop(l, ctx));
                *bound = Some(a);
                a
            }
        };
        self.enabled_epoch.store(epoch, Ordering::SeqCst);
        tracing::info!(listen = %addr, epoch, "egress enabled for this session");
        Ok(addr)
    }

    async fn accept_loop(self: Arc<Self>, l: TcpListener, ctx: Ctx) {
        loop {
            let (sock, peer) = match l.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "egress accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let epoch = ctx.epoch.load(Ordering::SeqCst);
            if !self.enabled(epoch) {
                tracing::debug!(%peer, "egress connection refused: not enabled by the current host");
                drop(sock);
                continue;
            }
            let (handle, ends) = tunnel_pair();
            let (opened_tx, opened_rx) = oneshot::channel();
            let id = {
                let mut t = lock(&ctx.table);
                // Checked under the table lock: a session end bumps the epoch
                // before clearing the table, so an entry inserted here for
                // `epoch` is either seen by that clear or not inserted at all.
                if ctx.epoch.load(Ordering::SeqCst) != epoch {
                    continue;
                }
                let id = loop {
                    // The port bit stays clear: port tunnel ids are the host's.
                    let n = self.next_id.fetch_add(1, Ordering::Relaxed) & !PORT_ID_BIT;
                    let id = TUNNEL_ID_BIT | n;
                    if !t.contains_key(&id) {
                        break id;
                    }
                };
                t.insert(
                    id,
                    (
                        epoch,
                        Entry::Tunnel {
                            handle,
                            opened: Some(opened_tx),
                        },
                    ),
                );
                id
            };
            let slot = Slot::new(
                &ctx.table,
                id,
                epoch,
                Outbox::new(ctx.out.clone(), Some(epoch)),
            );
            tokio::spawn(async move {
                let out = AgentTunnelOut {
                    id,
                    out: slot.out.clone(),
                };
                slot.out
                    .msg(
                        id,
                        &Response::TunnelOpen {
                            peer: peer.to_string(),
                        },
                    )
                    .await;
                match tokio::time::timeout(OPEN_TIMEOUT, opened_rx).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(why))) => {
                        // Debug only: a guest opening connections in a loop must not
                        // flood the console log.
                        tracing::debug!(id, %peer, %why, "host refused egress tunnel");
                        slot.release();
                        return;
                    }
                    Ok(Err(_)) => return, // session ended
                    Err(_) => {
                        tracing::warn!(id, "host did not answer a tunnel open");
                        slot.release();
                        out.send(TunnelMsg::Close(Some("open timed out".into())))
                            .await;
                        return;
                    }
                }
                tracing::debug!(id, %peer, "egress tunnel open");
                let _ = sock.set_nodelay(true);
                match run_tunnel(sock, ends, out).await {
                    TunnelEnd::Done { sent, received } => {
                        tracing::debug!(id, sent, received, "egress tunnel finished")
                    }
                    TunnelEnd::Aborted(why) => tracing::debug!(id, %why, "egress tunnel aborted"),
                }
                slot.release();
            });
        }
    }
}

/// Sends a tunnel's messages to the host (dropped once the session ends).
pub struct AgentTunnelOut {
    /// Tunnel id.
    pub id: u32,
    /// Session outbox.
    pub out: Outbox,
}

impl TunnelOut for AgentTunnelOut {
    async fn send(&self, msg: TunnelMsg) -> bool {
        match msg {
            TunnelMsg::Data(b) => self.out.data(FrameKind::Tunnel, self.id, b).await,
            TunnelMsg::Ack(bytes) => self.out.msg(self.id, &Response::TunnelAck { bytes }).await,
            TunnelMsg::Eof => self.out.msg(self.id, &Response::TunnelEof {}).await,
            TunnelMsg::Close(error) => {
                self.out
                    .msg(self.id, &Response::TunnelClose { error })
                    .await
            }
        }
        true
    }
}
