//! Host-side async client of the guest agent.
//!
//! One [`AgentClient`] multiplexes any number of concurrent requests over one
//! byte-stream connection: a reader task routes incoming frames by id, a
//! writer task serialises outgoing frames. Clones share the connection;
//! dropping every clone (and every handle) closes it.
//!
//! Contract (see `PROTOCOL.md`, *Sessions and resync*): the client connects,
//! sends the sync marker and `hello {version, nonce}` on id 0 and re-sends it
//! every [`HELLO_RESEND`] until `hello_ok` with its nonce arrives
//! (`version_mismatch` fails with [`AgentError::VersionMismatch`]). Given a
//! [`PortOpens`] counter (the VMM's report that the guest opened its end of
//! the port, QMP `VSERPORT_CHANGE`), it also re-sends Hello the moment the
//! counter moves instead of at the next resend; the guest side is unchanged. After
//! that every request is a fresh id; an `error` reply becomes
//! [`AgentError::Remote`]; a lost connection fails everything in flight with
//! [`AgentError::Closed`] and the caller reconnects.
//!
//! The rooms: this file holds the connection, the handshake and the
//! one-reply requests; `demux` the reader/writer tasks and the id table;
//! `exec` commands; `files` uploads, downloads and file operations;
//! `tunnel` guest egress; `ports` connections to guest ports; `watch`
//! directory watches.

mod demux;
mod exec;
mod files;
mod ports;
mod tunnel;
mod watch;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use strata_core::text::Escaped;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::demux::Shared;
pub use self::demux::{Liveness, CALL_BUFFER_CAP, CONNECTION_BUFFER_CAP, ITEM_OVERHEAD};
pub use self::exec::{
    EventStream, ExecEvent, ExecHandle, ExecInput, ExecOutput, ExecRequest, ExitStatus, Stdin,
    COLLECT_LIMIT, INPUT_QUEUE, OUTPUT_ACK_EVERY, OUTPUT_WINDOW, STDIN_CHUNK, STDIN_WINDOW,
};
pub use self::files::{FileDownload, WRITE_WINDOW};
pub use self::ports::{
    PortCounters, PortError, PortStream, PORT_CONNECT_TIMEOUT, PORT_STREAM_BUFFER, PORT_TUNNELS_MAX,
};
pub use self::tunnel::{
    OpenFuture, TunnelHandler, TunnelIo, TunnelService, TunnelStream, EGRESS_CONNECT_TIMEOUT,
};
pub use self::watch::{DirWatch, WatchBatch, WATCH_POLL_GRACE, WATCH_START_TIMEOUT};
use crate::frame::{Decoded, Frame, FrameDecoder, FrameError, FrameKind, SYNC_MAGIC};
use crate::msg::{AgentInfo, RemoteErrorKind, Request, Response, RestoreSync};
use crate::PROTOCOL_VERSION;

/// How long the client waits for a hello reply before sending Hello again.
pub const HELLO_RESEND: Duration = Duration::from_millis(40);

/// A counter the VMM bumps each time it sees the guest open its end of the
/// agent port (QEMU's `VSERPORT_CHANGE`): while the handshake waits, every
/// change re-sends Hello at once. The timed resend stays as the fallback
/// (older QEMUs, a lost event, a guest that opened before the watch began).
pub type PortOpens = tokio::sync::watch::Receiver<u64>;

/// What one connection's handshake did and when (for latency breakdowns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeStats {
    /// The connect call began.
    pub called: std::time::Instant,
    /// The socket connection the handshake succeeded on was made.
    pub connected: std::time::Instant,
    /// The last Hello before the answer was sent (the one answered, unless
    /// the agent answered an earlier copy late).
    pub last_hello: std::time::Instant,
    /// `hello_ok` arrived.
    pub hello_ok: std::time::Instant,
    /// Hellos sent, over every socket connection of this call.
    pub hellos: u32,
    /// Of them, sent at once because the port opened ([`PortOpens`]).
    pub triggered: u32,
    /// Socket connections made (more than one when the first closed).
    pub connections: u32,
}

/// Errors of the agent client.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Socket I/O failed.
    #[error("i/o error on the agent connection")]
    Io(#[from] std::io::Error),
    /// No agent answered the handshake in time.
    #[error("no agent answered within {0:?}")]
    ConnectTimeout(Duration),
    /// An operation exceeded its deadline.
    #[error("agent operation timed out")]
    Timeout,
    /// The connection is gone; in-flight requests fail with this.
    #[error("agent connection closed")]
    Closed,
    /// The agent sent something that is not valid protocol.
    #[error("agent protocol error")]
    Protocol(#[from] FrameError),
    /// Host and agent speak different protocol versions.
    #[error("agent speaks protocol version {agent}, host speaks {host}")]
    VersionMismatch {
        /// Host's version.
        host: u32,
        /// Agent's version.
        agent: u32,
    },
    /// The agent broke flow control on this request (sent beyond its
    /// window, or more than the client buffers for a request it does not
    /// window): the request was aborted and its command killed; the
    /// connection and the other requests go on.
    #[error("agent broke flow control: {0}")]
    FlowControl(String),
    /// The sandbox's agent predates a feature this request needs (an image
    /// built before it): nothing ran.
    #[error("this sandbox's agent does not support {feature}")]
    Unsupported {
        /// What it lacks, e.g. `PTYs`.
        feature: &'static str,
    },
    /// A collecting call's output passed its byte limit; the command was
    /// killed.
    #[error("command output exceeds the limit of {limit} bytes")]
    OutputLimit {
        /// The limit, stdout and stderr together.
        limit: u64,
    },
    /// The agent ran the request and reports a failure.
    #[error("agent: {kind}: {}", Escaped(.message))]
    Remote {
        /// Category.
        kind: RemoteErrorKind,
        /// Detail from the agent.
        message: String,
    },
}

impl AgentError {
    /// The remote error category, if this is a remote error.
    pub fn remote_kind(&self) -> Option<RemoteErrorKind> {
        match self {
            Self::Remote { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

struct Inner {
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    info: AgentInfo,
    reader: JoinHandle<()>,
    egress_listen: OnceLock<SocketAddr>,
    /// How the agent's tunnels are served: given at connect, or bound once
    /// later ([`AgentClient::bind_egress`]).
    egress: Arc<OnceLock<TunnelHandler>>,
    /// The command-output window the agent agreed to (unset: an older agent
    /// without output flow control).
    output_window: OnceLock<u64>,
    /// Port tunnels (host-opened).
    ports: Arc<ports::Ports>,
    /// How the handshake went.
    handshake: HandshakeStats,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        self.shared.close();
    }
}

/// Cheaply clonable handle to one agent connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("info", &self.inner.info)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// The counters of one connect call, over its socket connections.
struct Handshake {
    called: Instant,
    hellos: u32,
    triggered: u32,
    connections: u32,
}

/// Waits until the port-open counter moves (`true`), or forever without
/// one; `false` when its sender is gone.
async fn port_opened(port_opens: &mut Option<PortOpens>) -> bool {
    match port_opens {
        Some(rx) => rx.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

fn remote(kind: RemoteErrorKind, message: String) -> AgentError {
    AgentError::Remote { kind, message }
}

fn unexpected(r: &Response) -> AgentError {
    AgentError::Protocol(FrameError::Violation(format!("unexpected reply {r:?}")))
}

impl AgentClient {
    /// Connects to the agent behind a unix socket (QEMU's chardev socket or
    /// `strata-agent --listen-unix`) and performs the handshake.
    ///
    /// Retries the connect and re-sends Hello every [`HELLO_RESEND`] until an
    /// answer arrives or `timeout` passes: the socket may exist long before
    /// the guest agent listens, and after a restore the agent first sees the
    /// port close and reopen.
    pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<AgentClient, AgentError> {
        Self::connect_unix_with(path, timeout, None).await
    }

    /// Like [`AgentClient::connect_unix`]; with `egress`, the client also
    /// enables egress in the guest (the agent's listener forwards guest
    /// connections as tunnels, served by `egress`'s service).
    ///
    /// An agent that cannot enable egress (an older agent, or its listen
    /// address is taken) is logged and the client is returned without it:
    /// [`AgentClient::egress_listen`] is then `None` and the guest has no
    /// egress at all.
    ///
    /// Every connection also turns on command-output flow control
    /// ([`OUTPUT_WINDOW`], see [`AgentClient::output_window`]); an older
    /// agent without it is served with bounded buffers only.
    pub async fn connect_unix_with(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
    ) -> Result<AgentClient, AgentError> {
        Self::connect_unix_watched(path, timeout, egress, None).await
    }

    /// Like [`AgentClient::connect_unix_with`]; with `liveness`, the
    /// connection pings a quiet agent and closes itself when the agent stays
    /// silent (see [`Liveness`]): calls in flight fail instead of waiting
    /// forever, and the owner reconnects.
    pub async fn connect_unix_watched(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
        liveness: Option<Liveness>,
    ) -> Result<AgentClient, AgentError> {
        Self::connect_unix_cued(path, timeout, egress, liveness, None).await
    }

    /// Like [`AgentClient::connect_unix_watched`]; with `port_opens`, Hello
    /// is also re-sent the moment the counter moves (the guest opened its
    /// end of the port) rather than only every [`HELLO_RESEND`].
    pub async fn connect_unix_cued(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
        liveness: Option<Liveness>,
        port_opens: Option<PortOpens>,
    ) -> Result<AgentClient, AgentError> {
        let enable = egress.is_some();
        let client =
            Self::connect_unix_inner(path, timeout, egress, liveness, port_opens, HELLO_RESEND)
                .await?;
        client.negotiate_output_window(timeout).await;
        if enable {
            match tokio::time::timeout(timeout, client.enable_egress()).await {
                Ok(Ok(addr)) => {
                    tracing::debug!(listen = %addr, "guest egress enabled");
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "agent cannot enable egress; the guest has none");
                }
                Err(_) => {
                    tracing::warn!("agent did not answer egress_enable; the guest has no egress");
                }
            }
        }
        Ok(client)
    }

    /// Connects like [`AgentClient::connect_unix`] but leaves command output
    /// without flow control, as a host older than the output window does
    /// (for compatibility tests).
    pub async fn connect_unix_unwindowed(
        path: &Path,
        timeout: Duration,
    ) -> Result<AgentClient, AgentError> {
        Self::connect_unix_inner(path, timeout, None, None, None, HELLO_RESEND).await
    }

    async fn negotiate_output_window(&self, timeout: Duration) {
        match tokio::time::timeout(timeout, self.enable_output_window(OUTPUT_WINDOW)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::info!(
                error = %e,
                "agent has no output flow control (an older agent); output buffering is capped per request and connection"
            ),
            Err(_) => tracing::warn!(
                "agent did not answer output_window; running without output flow control"
            ),
        }
    }

    /// Asks the agent to window command output at `bytes` for this session
    /// (the client does it on connect). An older agent answers
    /// `invalid_argument`; commands then run without a window.
    pub async fn enable_output_window(&self, bytes: u64) -> Result<(), AgentError> {
        self.expect_ok(&Request::OutputWindow { bytes }).await?;
        let _ = self.inner.output_window.set(bytes);
        Ok(())
    }

    /// The command-output window of this connection; `None` with an older
    /// agent (then only [`CALL_BUFFER_CAP`] and [`CONNECTION_BUFFER_CAP`]
    /// bound what the client buffers).
    pub fn output_window(&self) -> Option<u64> {
        self.inner.output_window.get().copied()
    }

    /// Bytes of guest output this connection holds that no caller has read yet.
    pub fn buffered_bytes(&self) -> usize {
        self.inner.shared.buffered()
    }

    async fn connect_unix_inner(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
        liveness: Option<Liveness>,
        mut port_opens: Option<PortOpens>,
        resend: Duration,
    ) -> Result<AgentClient, AgentError> {
        let called = Instant::now();
        let deadline = called + timeout;
        let mut hs = Handshake {
            called,
            hellos: 0,
            triggered: 0,
            connections: 0,
        };
        // Openings before this call are not a cue: the first Hello goes out
        // on connect anyway.
        if let Some(p) = port_opens.as_mut() {
            p.borrow_and_update();
        }
        loop {
            if Instant::now() >= deadline {
                return Err(AgentError::ConnectTimeout(timeout));
            }
            let stream = match tokio::time::timeout_at(deadline, UnixStream::connect(path)).await {
                Err(_) => return Err(AgentError::ConnectTimeout(timeout)),
                Ok(Err(e)) => {
                    tracing::trace!(path = %path.display(), error = %e, "agent socket not ready");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Ok(Ok(s)) => s,
            };
            hs.connections += 1;
            match Self::handshake(
                stream,
                deadline,
                timeout,
                (resend, &mut port_opens, &mut hs),
                egress.clone(),
                liveness.clone(),
            )
            .await?
            {
                Some(client) => return Ok(client),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Handshake on one connection; `Ok(None)` if it closed (try again).
    async fn handshake(
        mut stream: UnixStream,
        deadline: Instant,
        timeout: Duration,
        (resend, port_opens, hs): (Duration, &mut Option<PortOpens>, &mut Handshake),
        egress: Option<TunnelHandler>,
        liveness: Option<Liveness>,
    ) -> Result<Option<AgentClient>, AgentError> {
        let connected = Instant::now();
        let nonce: u64 = rand::random();
        let mut hello = BytesMut::new();
        hello.extend_from_slice(&SYNC_MAGIC);
        Frame::control(
            0,
            &Request::Hello {
                version: PROTOCOL_VERSION,
                nonce,
            },
        )?
        .encode_into(&mut hello)?;
        let hello = hello.freeze();
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut cued = false;
        loop {
            // A paused guest reads nothing: bound the write by the deadline too,
            // or repeated Hellos fill the socket and the write blocks forever.
            match tokio::time::timeout_at(deadline, stream.write_all(&hello)).await {
                Err(_) => return Err(AgentError::ConnectTimeout(timeout)),
                Ok(Err(_)) => return Ok(None),
                Ok(Ok(())) => {}
            }
            let last_hello = Instant::now();
            hs.hellos += 1;
            if cued {
                hs.triggered += 1;
                tracing::trace!("hello re-sent: the guest opened the agent port");
            }
            cued = false;
            let resend_at = (last_hello + resend).min(deadline);
            loop {
                let read = tokio::time::timeout_at(resend_at, stream.read(&mut buf));
                let n = tokio::select! {
                    r = read => match r {
                        Err(_) => break,
                        Ok(Err(_)) | Ok(Ok(0)) => return Ok(None),
                        Ok(Ok(n)) => n,
                    },
                    opened = port_opened(port_opens) => {
                        if opened {
                            cued = true;
                            break;
                        }
                        // The VMM stopped reporting (its VM handle is gone):
                        // the timed resend alone from here on.
                        *port_opens = None;
                        continue;
                    }
                };
                dec.extend(&buf[..n]);
                loop {
                    let item = match dec.next_item() {
                        Ok(Some(i)) => i,
                        Ok(None) => break,
                        Err(e) => {
                            tracing::debug!(error = %e, "garbage before hello reply");
                            continue;
                        }
                    };
                    let Decoded::Frame(f) = item else { continue };
                    if f.kind != FrameKind::Control {
                        continue;
                    }
                    match f.parse::<Response>() {
                        Ok(Response::HelloOk { nonce: n, info }) if n == nonce => {
                            let stats = HandshakeStats {
                                called: hs.called.into_std(),
                                connected: connected.into_std(),
                                last_hello: last_hello.into_std(),
                                hello_ok: std::time::Instant::now(),
                                hellos: hs.hellos,
                                triggered: hs.triggered,
                                connections: hs.connections,
                            };
                            return Ok(Some(Self::start(
                                stream, dec, info, egress, liveness, stats,
                            )));
                        }
                        Ok(Response::VersionMismatch {
                            nonce: n,
                            host_version,
                            agent_version,
                        }) if n == nonce => {
                            return Err(AgentError::VersionMismatch {
                                host: host_version,
                                agent: agent_version,
                            });
                        }
                        _ => {}
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(AgentError::ConnectTimeout(timeout));
            }
        }
    }

    fn start(
        stream: UnixStream,
        dec: FrameDecoder,
        info: AgentInfo,
        egress: Option<TunnelHandler>,
        liveness: Option<Liveness>,
        handshake: HandshakeStats,
    ) -> AgentClient {
        let port_tunnels = Arc::new(ports::Ports::default());
        let pt = port_tunnels.clone();
        let handler = Arc::new(OnceLock::new());
        if let Some(h) = egress {
            let _ = handler.set(h);
        }
        let eg = handler.clone();
        let tunnels: demux::TunnelRouter = Box::new(move |shared, out, f| {
            if crate::tunnel::is_port_id(f.id) {
                ports::route(&pt, shared, out, f)
            } else {
                tunnel::route(eg.get(), shared, out, f)
            }
        });
        let conn = demux::spawn(stream, dec, tunnels, liveness);
        AgentClient {
            inner: Arc::new(Inner {
                shared: conn.shared,
                out: conn.out,
                info,
                reader: conn.reader,
                egress_listen: OnceLock::new(),
                egress: handler,
                output_window: OnceLock::new(),
                ports: port_tunnels,
                handshake,
            }),
        }
    }

    /// How this connection's handshake went (when each step ended, how
    /// many Hellos it took).
    pub fn handshake_stats(&self) -> HandshakeStats {
        self.inner.handshake
    }

    /// What the agent said in the handshake.
    pub fn info(&self) -> &AgentInfo {
        &self.inner.info
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.inner.shared.is_closed()
    }

    /// Calls in flight on this connection: requests waiting for or
    /// streaming their answer (exec, file transfers, watches), egress
    /// tunnels and port tunnels. Zero means nothing the host or the guest
    /// started through the agent is open now (what pressure-driven
    /// hibernation asks before it stops a VM).
    pub fn open_calls(&self) -> usize {
        self.inner.shared.open_calls() + self.inner.ports.open_count()
    }

    async fn send_frame(&self, frame: Frame) -> Result<(), AgentError> {
        let bytes = frame.encode()?;
        self.inner
            .out
            .send(bytes)
            .await
            .map_err(|_| AgentError::Closed)
    }

    async fn send_req(&self, id: u32, req: &Request) -> Result<(), AgentError> {
        self.send_frame(Frame::control(id, req)?).await
    }

    /// One request, one reply.
    async fn call(&self, req: &Request) -> Result<Response, AgentError> {
        let mut call = self.inner.shared.open()?;
        self.send_req(call.id, req).await?;
        match call.recv_msg().await? {
            Response::Error { kind, message } => Err(remote(kind, message)),
            r => Ok(r),
        }
    }

    /// One request whose reply is `ok`.
    async fn expect_ok(&self, req: &Request) -> Result<(), AgentError> {
        match self.call(req).await? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Round trip to the agent; returns its current facts.
    pub async fn ping(&self) -> Result<AgentInfo, AgentError> {
        match self.call(&Request::Ping {}).await? {
            Response::Pong { info } => Ok(info),
            r => Err(unexpected(&r)),
        }
    }

    /// After a snapshot restore: reseed the guest RNG, step its clock and
    /// (when given) take a new hostname / machine-id.
    pub async fn restore_sync(&self, req: RestoreSync) -> Result<(), AgentError> {
        self.expect_ok(&Request::RestoreSync(req)).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::net::UnixListener;
    use tokio::sync::{mpsc, watch};

    use super::*;

    /// An agent whose port is closed at first: it reads and ignores Hellos
    /// (what a guest that has not opened its end does) until `open` is set,
    /// then answers the next one. Reports each Hello it sees on `seen`.
    async fn late_agent(listener: UnixListener, open: Arc<AtomicBool>, seen: mpsc::Sender<()>) {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                return;
            }
            dec.extend(&buf[..n]);
            while let Ok(Some(item)) = dec.next_item() {
                let Decoded::Frame(f) = item else { continue };
                let Ok(Request::Hello { nonce, .. }) = f.parse::<Request>() else {
                    continue;
                };
                let _ = seen.send(()).await;
                if !open.load(Ordering::SeqCst) {
                    continue;
                }
                let mut out = BytesMut::new();
                out.extend_from_slice(&SYNC_MAGIC);
                let info = AgentInfo {
                    protocol_version: PROTOCOL_VERSION,
                    agent_version: "test".into(),
                    hostname: "late".into(),
                    boot_id: "b".into(),
                    uptime_ms: 1,
                };
                Frame::control(0, &Response::HelloOk { nonce, info })
                    .unwrap()
                    .encode_into(&mut out)
                    .unwrap();
                s.write_all(&out).await.unwrap();
            }
        }
    }

    fn listen() -> (tempfile::TempDir, std::path::PathBuf, UnixListener) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, path, listener)
    }

    #[tokio::test]
    async fn the_port_opening_sends_hello_at_once() {
        let (_dir, path, listener) = listen();
        let open = Arc::new(AtomicBool::new(false));
        let (seen_tx, mut seen) = mpsc::channel(16);
        tokio::spawn(late_agent(listener, open.clone(), seen_tx));
        let (opens_tx, opens) = watch::channel(0u64);
        // An opening reported before the connect is no cue.
        opens_tx.send_modify(|n| *n += 1);
        // A resend far beyond the test's patience: only the cue can answer.
        let resend = Duration::from_secs(60);
        let t0 = std::time::Instant::now();
        let connect = tokio::spawn(async move {
            AgentClient::connect_unix_inner(
                &path,
                Duration::from_secs(120),
                None,
                None,
                Some(opens),
                resend,
            )
            .await
        });
        // The first Hello goes out on connect and is ignored (port closed).
        seen.recv().await.unwrap();
        open.store(true, Ordering::SeqCst);
        opens_tx.send_modify(|n| *n += 1);
        let client = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .expect("the cue re-sent Hello well before the timed resend")
            .unwrap()
            .unwrap();
        let st = client.handshake_stats();
        assert_eq!(
            (st.hellos, st.triggered, st.connections),
            (2, 1, 1),
            "{st:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert!(st.called <= st.connected && st.last_hello <= st.hello_ok);
        assert_eq!(client.info().hostname, "late");
    }

    #[tokio::test]
    async fn without_a_cue_the_timed_resend_still_answers() {
        let (_dir, path, listener) = listen();
        let open = Arc::new(AtomicBool::new(false));
        let (seen_tx, mut seen) = mpsc::channel(16);
        tokio::spawn(late_agent(listener, open.clone(), seen_tx));
        let (opens_tx, opens) = watch::channel(0u64);
        let connect = tokio::spawn(async move {
            AgentClient::connect_unix_inner(
                &path,
                Duration::from_secs(20),
                None,
                None,
                Some(opens),
                Duration::from_millis(100),
            )
            .await
        });
        seen.recv().await.unwrap();
        open.store(true, Ordering::SeqCst);
        // The VMM's handle goes away without reporting the opening (an old
        // QEMU, a lost event): the client falls back to its timed resend.
        drop(opens_tx);
        let client = connect.await.unwrap().unwrap();
        let st = client.handshake_stats();
        assert_eq!(st.triggered, 0, "{st:?}");
        assert!(st.hellos >= 2, "{st:?}");
    }
}
