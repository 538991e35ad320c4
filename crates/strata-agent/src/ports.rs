//! Port tunnels: the host asks (`port_connect {port}`, on a host-chosen id
//! with `TUNNEL_ID_BIT` and `PORT_ID_BIT` set) for a connection to
//! `127.0.0.1:<port>` in the guest; the agent connects, answers
//! `port_connected` and pumps the socket as an egress tunnel (same
//! messages, same credit windows). Nothing listening answers `not_found`;
//! a bad id or a full table `other` (`invalid_argument` is what an older
//! agent answers to the unknown op).
//!
//! Bounds: at most [`MAX_PORT_TUNNELS`] port tunnels per session (each holds
//! at most one window per direction, as egress tunnels do); a connect that
//! takes longer than [`CONNECT_TIMEOUT`] fails. Ending the session clears
//! the table, which stops every tunnel and closes its socket.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_proto::tunnel::{is_port_id, run_tunnel, tunnel_pair, TunnelEnd};
use strata_proto::{RemoteErrorKind, Response};
use tokio::net::TcpStream;

use crate::egress::AgentTunnelOut;
use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::{lock, Entry, Slot, Table};

/// Most port tunnels of one session.
pub const MAX_PORT_TUNNELS: usize = 512;
/// How long connecting to the guest port may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `port_connect {port}` on `id` of session `epoch` (the current one
/// is in `current`): connects in a task, then pumps until either side ends.
pub fn connect(
    table: &Table,
    current: &Arc<AtomicU64>,
    out: Outbox,
    epoch: u64,
    id: u32,
    port: u16,
) {
    let table = table.clone();
    let current = current.clone();
    tokio::spawn(async move {
        if let Err(f) = check(&table, id, port) {
            return out.error(id, f).await;
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let sock = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let kind = match e.kind() {
                    std::io::ErrorKind::ConnectionRefused => RemoteErrorKind::NotFound,
                    _ => RemoteErrorKind::from_io(&e),
                };
                tracing::debug!(id, port, error = %e, "port connect failed");
                return out
                    .error(id, Fail::new(kind, format!("connect {addr}: {e}")))
                    .await;
            }
            Err(_) => {
                let f = Fail::new(RemoteErrorKind::Other, format!("connect {addr}: timed out"));
                return out.error(id, f).await;
            }
        };
        let _ = sock.set_nodelay(true);
        let (handle, ends) = tunnel_pair();
        let inserted = {
            let mut t = lock(&table);
            // A session that ended meanwhile has cleared the table: do not
            // put a row of it back.
            if current.load(Ordering::SeqCst) != epoch {
                return;
            }
            check_locked(&t, id, port).map(|()| {
                let row = Entry::Tunnel {
                    handle,
                    opened: None,
                };
                t.insert(id, (epoch, row));
            })
        };
        if let Err(f) = inserted {
            return out.error(id, f).await;
        }
        let slot = Slot::new(&table, id, epoch, out);
        slot.out.msg(id, &Response::PortConnected {}).await;
        tracing::debug!(id, port, "port tunnel open");
        let tun_out = AgentTunnelOut {
            id,
            out: slot.out.clone(),
        };
        match run_tunnel(sock, ends, tun_out).await {
            TunnelEnd::Done { sent, received } => {
                tracing::debug!(id, port, sent, received, "port tunnel finished")
            }
            TunnelEnd::Aborted(why) => tracing::debug!(id, port, %why, "port tunnel aborted"),
        }
        slot.release();
    });
}

fn check(table: &Table, id: u32, port: u16) -> Result<(), Fail> {
    check_locked(&lock(table), id, port)
}

fn check_locked(
    t: &std::collections::HashMap<u32, (u64, Entry)>,
    id: u32,
    port: u16,
) -> Result<(), Fail> {
    if port == 0 {
        return Err(Fail::new(RemoteErrorKind::Other, "port 0"));
    }
    if !is_port_id(id) || t.contains_key(&id) {
        return Err(Fail::new(
            RemoteErrorKind::Other,
            "port_connect needs a free port tunnel id",
        ));
    }
    let open = t.keys().filter(|k| is_port_id(**k)).count();
    if open >= MAX_PORT_TUNNELS {
        return Err(Fail::new(
            RemoteErrorKind::Other,
            format!("too many port tunnels (at most {MAX_PORT_TUNNELS})"),
        ));
    }
    Ok(())
}
