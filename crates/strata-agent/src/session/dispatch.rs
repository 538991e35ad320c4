//! Dispatch: what the agent does for each host request (see `PROTOCOL.md`,
//! *Requests*). Requests that outlive their first reply (exec, write_file,
//! read_file) get a row in the request table and a task that serves it;
//! stream data and acks for them are routed by the session loop through
//! that row. One-reply requests (list, stat, mkdir, remove, restore_sync)
//! run on the blocking pool and answer once. Tunnel messages of the host
//! (`tunnel_ok`, `tunnel_ack`, `tunnel_eof`, `tunnel_close`) go to their
//! tunnel's row; `watch` opens a directory watch's row (`watch.rs`), whose
//! polls and stop go to it. A request that would open a row under id 0 or an id in use
//! fails with `invalid_argument`.

use std::time::Duration;

use strata_proto::tunnel::TunnelMsg;
use strata_proto::{RemoteErrorKind, Request, Response};
use tokio::sync::{mpsc, watch};

use super::{agent_info, Session};
use crate::egress;
use crate::error::Fail;
use crate::exec::{self, Spec};
use crate::files;
use crate::outbox::Outbox;
use crate::requests::{lock, Entry, OutputCredit, Slot, UploadMsg};

/// Upload queue depth (chunks); the host's window is smaller.
const UPLOAD_QUEUE: usize =
    2 * (strata_proto::client::WRITE_WINDOW as usize / strata_proto::frame::MAX_FILE_CHUNK);

impl Session {
    /// Whether `id` cannot take a new request (connection-level, or in use).
    fn busy(&self, id: u32) -> bool {
        id == 0 || lock(&self.table).contains_key(&id)
    }

    /// Serves one request of the current session.
    pub(super) async fn request(&mut self, id: u32, req: Request) {
        let out = self.outbox();
        let epoch = self.epoch();
        let opens_entry = matches!(
            req,
            Request::Exec { .. } | Request::WriteFile { .. } | Request::ReadFile { .. }
        );
        if opens_entry && self.busy(id) {
            let f = Fail::new(RemoteErrorKind::InvalidArgument, "request id in use");
            return out.error(id, f).await;
        }
        match req {
            Request::Hello { .. } => {}
            Request::Ping {} => out.msg(id, &Response::Pong { info: agent_info() }).await,
            Request::Exec {
                command,
                env,
                cwd,
                user,
                stdin,
                timeout_ms,
                pty,
            } => {
                let spec = Spec {
                    command,
                    env,
                    cwd,
                    user,
                    stdin,
                    timeout: timeout_ms.map(Duration::from_millis),
                    proxy: self.egress.proxy_url(epoch),
                    pty,
                };
                let spawned = match exec::spawn(&spec) {
                    Ok(c) => c,
                    Err(f) => return out.error(id, f).await,
                };
                let pid = spawned.child.id().unwrap_or(0);
                let (stdin_tx, stdin_rx) = if stdin || pty.is_some() {
                    let (tx, rx) = mpsc::unbounded_channel();
                    (Some(tx), Some(rx))
                } else {
                    (None, None)
                };
                let (credit, window) = match self.output_window {
                    Some(size) => {
                        let (tx, rx) = watch::channel(OutputCredit::default());
                        (Some(tx), Some(exec::Window { size, credit: rx }))
                    }
                    None => (None, None),
                };
                let entry = Entry::Exec {
                    stdin: stdin_tx,
                    pgid: pid as i32,
                    output: credit,
                    pty: spawned.pty.clone(),
                };
                let slot = Slot::insert(&self.table, id, epoch, out, entry);
                tracing::debug!(id, pid, "started");
                slot.out.msg(id, &Response::Started { pid }).await;
                tokio::spawn(exec::run(spawned, spec.timeout, stdin_rx, window, slot));
            }
            Request::OutputWindow { bytes } => {
                if bytes == 0 {
                    let f = Fail::new(RemoteErrorKind::InvalidArgument, "output window of 0 bytes");
                    return out.error(id, f).await;
                }
                // Applies to commands started from now on.
                self.output_window = Some(bytes);
                tracing::debug!(bytes, "output flow control on");
                out.msg(id, &Response::Ok).await
            }
            Request::OutputAck { bytes } => {
                if let Some((
                    _,
                    Entry::Exec {
                        output: Some(c), ..
                    },
                )) = lock(&self.table).get(&id)
                {
                    c.send_if_modified(|c| {
                        let newer = bytes > c.acked;
                        if newer {
                            c.acked = bytes;
                        }
                        newer
                    });
                }
            }
            Request::OutputDiscard {} => {
                if let Some((
                    _,
                    Entry::Exec {
                        output: Some(c), ..
                    },
                )) = lock(&self.table).get(&id)
                {
                    c.send_modify(|c| c.discard = true);
                }
            }
            Request::Resize { cols, rows } => {
                let master = match lock(&self.table).get(&id) {
                    Some((_, Entry::Exec { pty: Some(m), .. })) => Some(m.clone()),
                    _ => None,
                };
                if let Some(m) = master {
                    if let Err(e) = exec::resize(&m, strata_proto::PtySize { cols, rows }) {
                        tracing::debug!(id, error = %e, "pty resize failed");
                    }
                }
            }
            Request::StdinClose {} => {
                if let Some((_, Entry::Exec { stdin, .. })) = lock(&self.table).get_mut(&id) {
                    *stdin = None;
                }
            }
            Request::Signal { signal } => {
                let pgid = match lock(&self.table).get(&id) {
                    Some((_, Entry::Exec { pgid, .. })) => Some(*pgid),
                    _ => None,
                };
                if let Some(pgid) = pgid {
                    exec::kill_group(pgid, signal);
                }
            }
            Request::WriteFile { path, mode } => {
                let p = path.clone();
                let opened = tokio::task::spawn_blocking(move || files::open_upload(&p, id))
                    .await
                    .unwrap_or_else(|e| Err(Fail::new(RemoteErrorKind::Other, e.to_string())));
                let (dest, tmp, file) = match opened {
                    Ok(x) => x,
                    Err(f) => return out.error(id, f).await,
                };
                let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
                let entry = Entry::Upload {
                    tx,
                    tmp: tmp.clone(),
                };
                let slot = Slot::insert(&self.table, id, epoch, out, entry);
                tokio::spawn(files::upload(dest, tmp, file, mode, rx, slot));
            }
            Request::WriteEnd {} => {
                if let Some((_, Entry::Upload { tx, .. })) = lock(&self.table).get(&id) {
                    let _ = tx.try_send(UploadMsg::End);
                }
            }
            Request::WriteAbort {} => {
                // Dropping the row's sender ends the upload task once it has
                // written what was queued, and it frees the slot. The
                // temporary file goes now, before the next request is read:
                // a listing the host sends after the abort never sees it.
                let removed = {
                    let mut t = lock(&self.table);
                    if matches!(t.get(&id), Some((e, Entry::Upload { .. })) if *e == epoch) {
                        t.remove(&id)
                    } else {
                        None
                    }
                };
                if let Some((_, Entry::Upload { tmp, .. })) = removed {
                    let _ = std::fs::remove_file(&tmp);
                }
            }
            Request::ReadFile { path } => {
                let (file, size) = match files::open_download(&path) {
                    Ok(x) => x,
                    Err(f) => return out.error(id, f).await,
                };
                let (acks, acks_rx) = watch::channel(0u64);
                let slot = Slot::insert(&self.table, id, epoch, out, Entry::Download { acks });
                tokio::spawn(files::download(file, size, acks_rx, slot));
            }
            Request::ReadAck { bytes } => {
                if let Some((_, Entry::Download { acks })) = lock(&self.table).get(&id) {
                    let _ = acks.send(bytes);
                }
            }
            Request::ListDir { path } => blocking_reply(out, id, move || {
                files::list_dir(&path).map(|entries| Response::Listing { entries })
            }),
            Request::Stat { path } => blocking_reply(out, id, move || {
                files::stat(&path).map(|stat| Response::Stat { stat })
            }),
            Request::MkdirAll { path, mode } => blocking_reply(out, id, move || {
                files::mkdir_all(&path, mode).map(|()| Response::Ok)
            }),
            Request::Remove { path, recursive } => blocking_reply(out, id, move || {
                files::remove(&path, recursive).map(|()| Response::Ok)
            }),
            Request::SetXattrs { path, prefix, set } => blocking_reply(out, id, move || {
                files::set_xattrs(&path, &prefix, &set).map(|()| Response::Ok)
            }),
            Request::EgressEnable {} => {
                let ctx = egress::Ctx {
                    out: self.transport.out.clone(),
                    epoch: self.transport.epoch.clone(),
                    table: self.table.clone(),
                };
                match self.egress.enable(epoch, ctx) {
                    Ok(a) => {
                        out.msg(
                            id,
                            &Response::EgressEnabled {
                                listen: a.to_string(),
                            },
                        )
                        .await
                    }
                    Err(f) => out.error(id, f).await,
                }
            }
            Request::TunnelOk {} => {
                if let Some((_, Entry::Tunnel { opened, .. })) = lock(&self.table).get_mut(&id) {
                    if let Some(o) = opened.take() {
                        let _ = o.send(Ok(()));
                    }
                }
            }
            Request::PortConnect { port } => {
                crate::ports::connect(&self.table, &self.transport.epoch, out, epoch, id, port)
            }
            Request::Watch { path, recursive } => {
                let (table, current) = (self.table.clone(), self.transport.epoch.clone());
                tokio::spawn(crate::watch::start(
                    table, current, epoch, out, id, path, recursive,
                ));
            }
            Request::WatchPoll { wait_ms } => {
                let polls = match lock(&self.table).get(&id) {
                    Some((_, Entry::Watch { polls })) => Some(polls.clone()),
                    _ => None,
                };
                match polls {
                    // More polls in flight than the queue holds: the host
                    // broke the one-at-a-time rule; the extra one is dropped.
                    Some(p) => {
                        if p.try_send(wait_ms).is_err() {
                            tracing::debug!(id, "watch poll dropped: too many in flight");
                        }
                    }
                    None => {
                        let f = Fail::new(RemoteErrorKind::NotFound, "no watch on this id");
                        out.error(id, f).await
                    }
                }
            }
            Request::WatchStop {} => {
                let mut t = lock(&self.table);
                if matches!(t.get(&id), Some((_, Entry::Watch { .. }))) {
                    t.remove(&id);
                }
            }
            Request::TunnelAck { bytes } => self.tunnel_msg(id, TunnelMsg::Ack(bytes)).await,
            Request::TunnelEof {} => self.tunnel_msg(id, TunnelMsg::Eof).await,
            Request::TunnelClose { error } => self.tunnel_msg(id, TunnelMsg::Close(error)).await,
            Request::RestoreSync(rs) => {
                let sys = self.sys.clone();
                tracing::info!(
                    entropy = rs.entropy.len(),
                    hostname = ?rs.hostname,
                    machine_id = ?rs.machine_id,
                    "restore sync"
                );
                blocking_reply(out, id, move || {
                    crate::system::restore_sync(sys.as_ref(), &rs).map(|()| Response::Ok)
                })
            }
        }
    }
}

/// Runs `f` on the blocking pool and sends its result as the reply.
fn blocking_reply<F>(out: Outbox, id: u32, f: F)
where
    F: FnOnce() -> Result<Response, Fail> + Send + 'static,
{
    tokio::spawn(async move {
        let r = tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
            Err(Fail::new(
                RemoteErrorKind::Other,
                format!("internal error: {e}"),
            ))
        });
        match r {
            Ok(resp) => out.msg(id, &resp).await,
            Err(f) => out.error(id, f).await,
        }
    });
}
