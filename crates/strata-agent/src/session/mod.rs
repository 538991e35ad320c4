//! The session loop: decodes frames from the transport, tracks the host
//! session (Hello with nonce), dispatches requests and routes stream data.
//!
//! A session ends when the host disconnects, a new Hello (new nonce)
//! arrives, or a frame is malformed. Ending a session drops its request
//! table: uploads are abandoned (partial files removed), downloads stop,
//! stdin pipes close; running commands keep running, their output is dropped.
//!
//! This file is the loop and the session rules; `dispatch` starts the
//! request each control message asks for.

mod dispatch;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_proto::frame::{Decoded, Frame, FrameDecoder, FrameError, FrameKind};
use strata_proto::tunnel::{Delivered, TunnelMsg};
use strata_proto::{AgentInfo, RemoteErrorKind, Request, Response, PROTOCOL_VERSION};

use crate::egress::Egress;
use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::{lock, Entry, Table, UploadMsg};
use crate::system::System;
use crate::transport::{Event, Transport};

/// A frame that has started but not completed within this time is taken to
/// be a stale fragment of an earlier host (hosts write whole frames at once).
const STALE_PARTIAL: Duration = Duration::from_secs(3);

/// Agent state for one transport.
pub struct Session {
    transport: Transport,
    sys: Arc<dyn System>,
    table: Table,
    nonce: Option<u64>,
    awaiting_hello: bool,
    version: u32,
    egress: Arc<Egress>,
    /// The command-output window the host asked for in this session.
    output_window: Option<u64>,
}

/// Current agent facts.
pub fn agent_info() -> AgentInfo {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    let uptime_ms = read("/proc/uptime")
        .split_whitespace()
        .next()
        .and_then(|s| s.parse::<f64>().ok())
        .map(|s| (s * 1000.0) as u64)
        .unwrap_or(0);
    AgentInfo {
        protocol_version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        hostname: read("/proc/sys/kernel/hostname"),
        boot_id: read("/proc/sys/kernel/random/boot_id"),
        uptime_ms,
    }
}

impl Session {
    /// A session loop over `transport`.
    pub fn new(
        transport: Transport,
        sys: Arc<dyn System>,
        version: u32,
        egress: Arc<Egress>,
    ) -> Self {
        Self {
            version,
            egress,
            transport,
            sys,
            table: Arc::new(Mutex::new(HashMap::new())),
            nonce: None,
            awaiting_hello: false,
            output_window: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.transport.epoch.load(Ordering::SeqCst)
    }

    fn outbox(&self) -> Outbox {
        Outbox::new(self.transport.out.clone(), Some(self.epoch()))
    }

    fn end_session(&mut self, why: &str) {
        if self.nonce.is_some() {
            tracing::info!(why, "session ended");
        }
        self.nonce = None;
        self.awaiting_hello = false;
        self.output_window = None;
        self.transport.epoch.fetch_add(1, Ordering::SeqCst);
        lock(&self.table).clear();
    }

    /// Runs until the transport goes away (never, in practice).
    pub async fn run(mut self) {
        let mut dec = FrameDecoder::new();
        let mut conn = 0u64;
        let mut partial_since: Option<tokio::time::Instant> = None;
        loop {
            let ev = match partial_since {
                None => self.transport.events.recv().await,
                Some(t) => {
                    match tokio::time::timeout_at(t + STALE_PARTIAL, self.transport.events.recv())
                        .await
                    {
                        Ok(ev) => ev,
                        Err(_) => {
                            tracing::warn!(
                                buffered = dec.buffered(),
                                "partial frame never completed; resynchronising"
                            );
                            dec.abandon_partial();
                            self.end_session("stale partial frame");
                            partial_since = None;
                            self.drain(&mut dec).await;
                            continue;
                        }
                    }
                }
            };
            let Some(ev) = ev else { break };
            match ev {
                Event::Connected(g) => {
                    conn = g;
                    dec.reset();
                    self.end_session("new host connection");
                }
                Event::Disconnected(g) => {
                    if g != conn {
                        continue;
                    }
                    if let Err(e) = dec.finish() {
                        tracing::warn!(error = %e, "host connection ended inside a frame");
                    }
                    dec.reset();
                    self.end_session("host disconnected");
                }
                Event::Bytes(g, data) => {
                    if g != conn {
                        continue;
                    }
                    dec.extend(&data);
                    let before = dec.buffered();
                    self.drain(&mut dec).await;
                    // Restart the stale timer whenever a frame completes.
                    if !dec.has_partial() {
                        partial_since = None;
                    } else if partial_since.is_none() || dec.buffered() < before {
                        partial_since = Some(tokio::time::Instant::now());
                    }
                }
            }
            if !dec.has_partial() {
                partial_since = None;
            }
        }
    }

    /// Handles every complete item in the decoder.
    async fn drain(&mut self, dec: &mut FrameDecoder) {
        loop {
            match dec.next_item() {
                Ok(None) => break,
                Ok(Some(Decoded::Sync)) => self.awaiting_hello = true,
                Ok(Some(Decoded::Frame(f))) => self.on_frame(f, dec).await,
                Err(e) => self.protocol_error(e, dec).await,
            }
        }
    }

    async fn protocol_error(&mut self, e: FrameError, dec: &mut FrameDecoder) {
        tracing::warn!(error = %e, "protocol error; resynchronising");
        // Sent regardless of epoch so the host learns why its session ended.
        Outbox::new(self.transport.out.clone(), None)
            .msg(
                0,
                &Response::Error {
                    kind: RemoteErrorKind::Protocol,
                    message: e.to_string(),
                },
            )
            .await;
        if dec.is_synced() {
            dec.reset();
        }
        self.end_session("protocol error");
    }

    async fn on_frame(&mut self, f: Frame, dec: &mut FrameDecoder) {
        if self.awaiting_hello {
            self.awaiting_hello = false;
            match f.parse::<Request>() {
                Ok(Request::Hello { version, nonce }) => return self.hello(version, nonce).await,
                Ok(_) => {
                    let e =
                        FrameError::Violation("the sync marker must be followed by hello".into());
                    return self.protocol_error(e, dec).await;
                }
                Err(e) => return self.protocol_error(e, dec).await,
            }
        }
        if f.kind == FrameKind::Control {
            match f.parse::<Request>() {
                Ok(Request::Hello { version, nonce }) => self.hello(version, nonce).await,
                Ok(_) if self.nonce.is_none() => {
                    let e = FrameError::Violation("request before hello".into());
                    self.protocol_error(e, dec).await;
                }
                Ok(req) => self.request(f.id, req).await,
                Err(e) if self.nonce.is_some() && f.id != 0 => {
                    // Well framed but not understood: fail just that request.
                    self.outbox()
                        .error(
                            f.id,
                            Fail::new(
                                RemoteErrorKind::InvalidArgument,
                                format!("bad request: {e}"),
                            ),
                        )
                        .await;
                }
                Err(e) => self.protocol_error(e, dec).await,
            }
            return;
        }
        if self.nonce.is_none() {
            let e = FrameError::Violation("data before hello".into());
            return self.protocol_error(e, dec).await;
        }
        self.data(f).await;
    }

    async fn hello(&mut self, version: u32, nonce: u64) {
        if version != self.version {
            tracing::warn!(
                host = version,
                agent = self.version,
                "protocol version mismatch"
            );
            self.end_session("version mismatch");
            self.outbox()
                .sync_msg(
                    0,
                    &Response::VersionMismatch {
                        nonce,
                        host_version: version,
                        agent_version: self.version,
                    },
                )
                .await;
            return;
        }
        if self.nonce != Some(nonce) {
            self.end_session("new session");
            self.nonce = Some(nonce);
            tracing::info!(nonce, "session started");
        }
        self.outbox()
            .sync_msg(
                0,
                &Response::HelloOk {
                    nonce,
                    info: agent_info(),
                },
            )
            .await;
    }

    /// Routes a host message to tunnel `id`; aborts the tunnel if the host broke its rules.
    async fn tunnel_msg(&mut self, id: u32, msg: TunnelMsg) {
        let abort = {
            let mut table = lock(&self.table);
            let Some((_, Entry::Tunnel { handle, opened })) = table.get_mut(&id) else {
                return; // late message for a finished tunnel
            };
            if let TunnelMsg::Close(error) = &msg {
                if let Some(o) = opened.take() {
                    let _ = o.send(Err(error.clone().unwrap_or_else(|| "refused".into())));
                }
            }
            let delivered = if opened.is_some() && !matches!(msg, TunnelMsg::Close(_)) {
                Delivered::Abort("tunnel message before tunnel_ok".into())
            } else {
                handle.deliver(msg)
            };
            match delivered {
                Delivered::Keep => None,
                Delivered::Remove => {
                    table.remove(&id);
                    None
                }
                Delivered::Abort(why) => {
                    table.remove(&id);
                    Some(why)
                }
            }
        };
        if let Some(why) = abort {
            self.tunnel_abort(id, why).await;
        }
    }

    async fn tunnel_abort(&self, id: u32, why: String) {
        tracing::warn!(id, %why, "host broke tunnel rules; closing the tunnel");
        self.outbox()
            .msg(id, &Response::TunnelClose { error: Some(why) })
            .await;
    }

    async fn data(&mut self, f: Frame) {
        if f.kind == FrameKind::Tunnel {
            return self.tunnel_msg(f.id, TunnelMsg::Data(f.payload)).await;
        }
        let overrun = {
            let mut table = lock(&self.table);
            let Some((_, entry)) = table.get_mut(&f.id) else {
                return; // late data for a finished request
            };
            match (f.kind, entry) {
                (
                    FrameKind::Stdin,
                    Entry::Exec {
                        stdin: Some(tx), ..
                    },
                ) => {
                    let _ = tx.send(f.payload);
                    false
                }
                (FrameKind::FileData, Entry::Upload { tx, .. }) => {
                    let full = tx.try_send(UploadMsg::Data(f.payload)).is_err();
                    if full {
                        table.remove(&f.id);
                    }
                    full
                }
                _ => false,
            }
        };
        if overrun {
            tracing::warn!(id = f.id, "host overran the upload window; aborting upload");
            self.outbox()
                .error(
                    f.id,
                    Fail::new(RemoteErrorKind::Protocol, "upload window exceeded"),
                )
                .await;
        }
    }
}
