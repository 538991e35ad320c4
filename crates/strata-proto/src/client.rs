//! Host-side async client of the guest agent.
//!
//! One [`AgentClient`] multiplexes any number of concurrent requests over one
//! byte-stream connection: a reader task routes incoming frames by id, a
//! writer task serialises outgoing frames. Clones share the connection;
//! dropping every clone (and every handle) closes it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::Stream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::frame::{
    Decoded, Frame, FrameDecoder, FrameError, FrameKind, MAX_FILE_CHUNK, SYNC_MAGIC,
};
use crate::msg::{
    AgentInfo, Command, DirEntry, FileStat, RemoteErrorKind, Request, Response, RestoreSync,
};
use crate::tunnel::{
    is_tunnel_id, run_tunnel, tunnel_pair, Delivered, TunnelEnd, TunnelHandle, TunnelMsg,
    TunnelOut, TUNNEL_ID_BIT,
};
use crate::PROTOCOL_VERSION;

/// How long the client waits for a hello reply before sending Hello again.
pub const HELLO_RESEND: Duration = Duration::from_millis(40);
/// Unacknowledged upload bytes the client may have in flight.
pub const WRITE_WINDOW: u64 = 16 * MAX_FILE_CHUNK as u64;
/// Unacknowledged stdin bytes the client may have in flight.
pub const STDIN_WINDOW: u64 = 1024 * 1024;
/// Size of one stdin data frame.
pub const STDIN_CHUNK: usize = 64 * 1024;
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
    /// The agent ran the request and reports a failure.
    #[error("agent: {kind}: {message}")]
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

/// Stdin of a command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Stdin {
    /// `/dev/null`.
    #[default]
    Null,
    /// These bytes, then end of file.
    Bytes(Vec<u8>),
    /// A pipe fed through [`ExecHandle::write_stdin`].
    Stream,
}

/// A command to run in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    /// Argv or shell string.
    pub command: Command,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Working directory (absolute).
    pub cwd: Option<String>,
    /// User name or uid to run as.
    pub user: Option<String>,
    /// Stdin source.
    pub stdin: Stdin,
    /// Kill the whole process group after this long.
    pub timeout: Option<Duration>,
}

impl ExecRequest {
    /// Runs `argv` with defaults for everything else.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// Runs `script` with `/bin/sh -c`.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(Command::Shell(script.into()))
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            env: BTreeMap::new(),
            cwd: None,
            user: None,
            stdin: Stdin::Null,
            timeout: None,
        }
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal, if it was killed.
    pub signal: Option<i32>,
    /// Killed because its timeout expired.
    pub timed_out: bool,
}

impl ExitStatus {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// One event of a running command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// The process started.
    Started {
        /// Guest pid (= process group id).
        pid: u32,
    },
    /// A chunk of stdout.
    Stdout(Bytes),
    /// A chunk of stderr.
    Stderr(Bytes),
    /// The command ended; the last event.
    Exit(ExitStatus),
}

/// Collected result of [`AgentClient::exec_collect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// All of stdout.
    pub stdout: Vec<u8>,
    /// All of stderr.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub status: ExitStatus,
}

enum Incoming {
    Msg(Response),
    Data(FrameKind, Bytes),
}

struct Shared {
    routes: Mutex<HashMap<u32, mpsc::UnboundedSender<Incoming>>>,
    tunnels: Mutex<HashMap<u32, TunnelHandle>>,
    egress: Option<TunnelHandler>,
    closed: AtomicBool,
    next_id: AtomicU32,
}

impl Shared {
    fn routes(&self) -> MutexGuard<'_, HashMap<u32, mpsc::UnboundedSender<Incoming>>> {
        // A poisoned lock only means another task panicked mid-insert; the map is still usable.
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn tunnels(&self) -> MutexGuard<'_, HashMap<u32, TunnelHandle>> {
        self.tunnels.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.routes().clear();
        // Dropping the handles stops their pumps (sockets closed).
        let tunnels = std::mem::take(&mut *self.tunnels());
        drop(tunnels);
    }
}

struct Inner {
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    info: AgentInfo,
    reader: JoinHandle<()>,
    egress_listen: OnceLock<SocketAddr>,
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

/// A registered request id; unregisters on drop.
struct Call {
    id: u32,
    rx: mpsc::UnboundedReceiver<Incoming>,
    shared: Arc<Shared>,
}

impl Drop for Call {
    fn drop(&mut self) {
        self.shared.routes().remove(&self.id);
    }
}

impl Call {
    async fn recv(&mut self) -> Result<Incoming, AgentError> {
        self.rx.recv().await.ok_or(AgentError::Closed)
    }

    /// Next control message, ignoring data frames.
    async fn recv_msg(&mut self) -> Result<Response, AgentError> {
        loop {
            if let Incoming::Msg(m) = self.recv().await? {
                return Ok(m);
            }
        }
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
    /// connections as tunnels, served by connecting to `egress.target`).
    ///
    /// An agent that cannot enable egress (an older agent, or its listen
    /// address is taken) is logged and the client is returned without it:
    /// [`AgentClient::egress_listen`] is then `None` and the guest has no
    /// egress at all.
    pub async fn connect_unix_with(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
    ) -> Result<AgentClient, AgentError> {
        let client = Self::connect_unix_inner(path, timeout, egress).await?;
        if egress.is_some() {
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

    async fn connect_unix_inner(
        path: &Path,
        timeout: Duration,
        egress: Option<TunnelHandler>,
    ) -> Result<AgentClient, AgentError> {
        let deadline = Instant::now() + timeout;
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
            match Self::handshake(stream, deadline, timeout, egress).await? {
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
        egress: Option<TunnelHandler>,
    ) -> Result<Option<AgentClient>, AgentError> {
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
        loop {
            // A paused guest reads nothing: bound the write by the deadline too,
            // or repeated Hellos fill the socket and the write blocks forever.
            match tokio::time::timeout_at(deadline, stream.write_all(&hello)).await {
                Err(_) => return Err(AgentError::ConnectTimeout(timeout)),
                Ok(Err(_)) => return Ok(None),
                Ok(Ok(())) => {}
            }
            let resend_at = (Instant::now() + HELLO_RESEND).min(deadline);
            loop {
                let n = match tokio::time::timeout_at(resend_at, stream.read(&mut buf)).await {
                    Err(_) => break,
                    Ok(Err(_)) | Ok(Ok(0)) => return Ok(None),
                    Ok(Ok(n)) => n,
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
                            return Ok(Some(Self::start(stream, dec, info, egress)));
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
    ) -> AgentClient {
        let (rd, wr) = stream.into_split();
        let shared = Arc::new(Shared {
            routes: Mutex::new(HashMap::new()),
            tunnels: Mutex::new(HashMap::new()),
            egress,
            closed: AtomicBool::new(false),
            next_id: AtomicU32::new(1),
        });
        let (out, out_rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(writer_task(wr, out_rx, shared.clone()));
        let reader = tokio::spawn(reader_task(rd, dec, shared.clone(), out.clone()));
        AgentClient {
            inner: Arc::new(Inner {
                shared,
                out,
                info,
                reader,
                egress_listen: OnceLock::new(),
            }),
        }
    }

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

    /// What the agent said in the handshake.
    pub fn info(&self) -> &AgentInfo {
        &self.inner.info
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.inner.shared.closed.load(Ordering::SeqCst)
    }

    fn open(&self) -> Result<Call, AgentError> {
        let shared = &self.inner.shared;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut routes = shared.routes();
        if shared.closed.load(Ordering::SeqCst) {
            return Err(AgentError::Closed);
        }
        let id = loop {
            // Host ids keep the high bit clear: those ids belong to the agent's tunnels.
            let id = shared.next_id.fetch_add(1, Ordering::Relaxed) & !TUNNEL_ID_BIT;
            if id != 0 && !routes.contains_key(&id) {
                break id;
            }
        };
        routes.insert(id, tx);
        Ok(Call {
            id,
            rx,
            shared: shared.clone(),
        })
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
        let mut call = self.open()?;
        self.send_req(call.id, req).await?;
        match call.recv_msg().await? {
            Response::Error { kind, message } => Err(remote(kind, message)),
            r => Ok(r),
        }
    }

    /// Round trip to the agent; returns its current facts.
    pub async fn ping(&self) -> Result<AgentInfo, AgentError> {
        match self.call(&Request::Ping {}).await? {
            Response::Pong { info } => Ok(info),
            r => Err(unexpected(&r)),
        }
    }

    /// Starts a command. Spawn failures arrive as the first event
    /// (`Err(Remote{SpawnFailed|NotFound|...})`).
    pub async fn exec(&self, req: ExecRequest) -> Result<ExecHandle, AgentError> {
        let call = self.open()?;
        let wire = Request::Exec {
            command: req.command,
            env: req.env,
            cwd: req.cwd,
            user: req.user,
            stdin: !matches!(req.stdin, Stdin::Null),
            timeout_ms: req
                .timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        };
        self.send_req(call.id, &wire).await?;
        let mut h = ExecHandle {
            client: self.clone(),
            call,
            pending: VecDeque::new(),
            stdin_sent: 0,
            stdin_acked: 0,
            finished: false,
        };
        if let Stdin::Bytes(data) = req.stdin {
            match h.write_stdin(&data).await {
                Ok(()) => h.close_stdin().await?,
                // The command ended without reading all of it: like a broken pipe.
                Err(AgentError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) => return Err(e),
            }
        }
        Ok(h)
    }

    /// Runs a command to the end and collects its output.
    pub async fn exec_collect(&self, req: ExecRequest) -> Result<ExecOutput, AgentError> {
        let mut h = self.exec(req).await?;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        while let Some(ev) = h.next_event().await {
            match ev? {
                ExecEvent::Started { .. } => {}
                ExecEvent::Stdout(b) => stdout.extend_from_slice(&b),
                ExecEvent::Stderr(b) => stderr.extend_from_slice(&b),
                ExecEvent::Exit(status) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        status,
                    })
                }
            }
        }
        Err(AgentError::Closed)
    }

    /// Streams `reader` into `path` in the guest, with flow control (bounded
    /// memory on both sides). The agent writes a temporary file beside `path`
    /// and renames it at the end; on failure nothing is left behind. Returns
    /// the bytes written.
    pub async fn write_file<R>(
        &self,
        path: &str,
        mode: Option<u32>,
        mut reader: R,
    ) -> Result<u64, AgentError>
    where
        R: AsyncRead + Unpin + Send,
    {
        let mut call = self.open()?;
        self.send_req(
            call.id,
            &Request::WriteFile {
                path: path.to_owned(),
                mode,
            },
        )
        .await?;
        let mut sent: u64 = 0;
        let mut acked: u64 = 0;
        let mut eof = false;
        while !eof {
            // Pick up early errors and acks without blocking.
            loop {
                let inc = match call.rx.try_recv() {
                    Ok(i) => i,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return Err(AgentError::Closed),
                };
                handle_write_reply(inc, &mut acked)?;
            }
            if sent - acked >= WRITE_WINDOW {
                let inc = call.recv().await?;
                handle_write_reply(inc, &mut acked)?;
                continue;
            }
            let mut chunk = BytesMut::with_capacity(MAX_FILE_CHUNK);
            while chunk.len() < MAX_FILE_CHUNK {
                if reader.read_buf(&mut chunk).await? == 0 {
                    eof = true;
                    break;
                }
            }
            if !chunk.is_empty() {
                sent += chunk.len() as u64;
                self.send_frame(Frame::data(FrameKind::FileData, call.id, chunk.freeze()))
                    .await?;
            }
        }
        self.send_req(call.id, &Request::WriteEnd {}).await?;
        loop {
            match call.recv_msg().await? {
                Response::Ack { .. } => {}
                Response::Done { bytes } => return Ok(bytes),
                Response::Error { kind, message } => return Err(remote(kind, message)),
                r => return Err(unexpected(&r)),
            }
        }
    }

    /// Opens `path` in the guest for streaming download.
    pub async fn read_file(&self, path: &str) -> Result<FileDownload, AgentError> {
        let mut call = self.open()?;
        self.send_req(
            call.id,
            &Request::ReadFile {
                path: path.to_owned(),
            },
        )
        .await?;
        match call.recv_msg().await? {
            Response::FileStart { size } => Ok(FileDownload {
                client: self.clone(),
                call,
                size,
                consumed: 0,
                done: false,
            }),
            Response::Error { kind, message } => Err(remote(kind, message)),
            r => Err(unexpected(&r)),
        }
    }

    /// Lists a directory, sorted by name.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, AgentError> {
        match self
            .call(&Request::ListDir {
                path: path.to_owned(),
            })
            .await?
        {
            Response::Listing { entries } => Ok(entries),
            r => Err(unexpected(&r)),
        }
    }

    /// Metadata of `path` (symlinks not followed); `None` if it does not exist.
    pub async fn stat(&self, path: &str) -> Result<Option<FileStat>, AgentError> {
        match self
            .call(&Request::Stat {
                path: path.to_owned(),
            })
            .await?
        {
            Response::Stat { stat } => Ok(stat),
            r => Err(unexpected(&r)),
        }
    }

    /// `mkdir -p path` with `mode` (default 0o755) for created directories.
    pub async fn mkdir_all(&self, path: &str, mode: Option<u32>) -> Result<(), AgentError> {
        self.expect_ok(&Request::MkdirAll {
            path: path.to_owned(),
            mode,
        })
        .await
    }

    /// Removes a file, symlink or (empty, or with `recursive` any) directory.
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        self.expect_ok(&Request::Remove {
            path: path.to_owned(),
            recursive,
        })
        .await
    }

    /// After a snapshot restore: reseed the guest RNG, step its clock and
    /// (when given) take a new hostname / machine-id.
    pub async fn restore_sync(&self, req: RestoreSync) -> Result<(), AgentError> {
        self.expect_ok(&Request::RestoreSync(req)).await
    }

    async fn expect_ok(&self, req: &Request) -> Result<(), AgentError> {
        match self.call(req).await? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&r)),
        }
    }
}

fn handle_write_reply(inc: Incoming, acked: &mut u64) -> Result<(), AgentError> {
    match inc {
        Incoming::Msg(Response::Ack { bytes }) => {
            *acked = bytes;
            Ok(())
        }
        Incoming::Msg(Response::Error { kind, message }) => Err(remote(kind, message)),
        Incoming::Msg(r) => Err(unexpected(&r)),
        Incoming::Data(..) => Ok(()),
    }
}

/// A running command.
pub struct ExecHandle {
    client: AgentClient,
    call: Call,
    pending: VecDeque<Incoming>,
    stdin_sent: u64,
    stdin_acked: u64,
    finished: bool,
}

impl std::fmt::Debug for ExecHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandle")
            .field("id", &self.call.id)
            .field("finished", &self.finished)
            .finish()
    }
}

impl ExecHandle {
    /// Next event; `None` after the `Exit` event (or an error).
    pub async fn next_event(&mut self) -> Option<Result<ExecEvent, AgentError>> {
        loop {
            if self.finished {
                return None;
            }
            let inc = match self.pending.pop_front() {
                Some(i) => i,
                None => match self.call.recv().await {
                    Ok(i) => i,
                    Err(e) => {
                        self.finished = true;
                        return Some(Err(e));
                    }
                },
            };
            match inc {
                Incoming::Data(FrameKind::Stdout, b) => return Some(Ok(ExecEvent::Stdout(b))),
                Incoming::Data(FrameKind::Stderr, b) => return Some(Ok(ExecEvent::Stderr(b))),
                Incoming::Data(..) => {}
                Incoming::Msg(Response::Ack { bytes }) => self.stdin_acked = bytes,
                Incoming::Msg(Response::Started { pid }) => {
                    return Some(Ok(ExecEvent::Started { pid }))
                }
                Incoming::Msg(Response::Exit {
                    code,
                    signal,
                    timed_out,
                }) => {
                    self.finished = true;
                    return Some(Ok(ExecEvent::Exit(ExitStatus {
                        code,
                        signal,
                        timed_out,
                    })));
                }
                Incoming::Msg(Response::Error { kind, message }) => {
                    self.finished = true;
                    return Some(Err(remote(kind, message)));
                }
                Incoming::Msg(r) => {
                    self.finished = true;
                    return Some(Err(unexpected(&r)));
                }
            }
        }
    }

    /// Whether the exit (or a terminal error) was seen, buffered or consumed.
    fn ended(&self) -> bool {
        self.finished
            || self.pending.iter().any(|i| {
                matches!(
                    i,
                    Incoming::Msg(Response::Exit { .. }) | Incoming::Msg(Response::Error { .. })
                )
            })
    }

    /// Writes to the command's stdin (requires `Stdin::Stream` or `Bytes`).
    /// Waits when the agent has not consumed the previous bytes yet; fails with
    /// a `BrokenPipe` I/O error once the command has ended.
    pub async fn write_stdin(&mut self, data: &[u8]) -> Result<(), AgentError> {
        for chunk in data.chunks(STDIN_CHUNK) {
            while self.stdin_sent - self.stdin_acked >= STDIN_WINDOW {
                if self.ended() {
                    return Err(broken_pipe());
                }
                match self.call.recv().await? {
                    Incoming::Msg(Response::Ack { bytes }) => self.stdin_acked = bytes,
                    other => self.pending.push_back(other),
                }
            }
            if self.ended() {
                return Err(broken_pipe());
            }
            self.stdin_sent += chunk.len() as u64;
            self.client
                .send_frame(Frame::data(
                    FrameKind::Stdin,
                    self.call.id,
                    Bytes::copy_from_slice(chunk),
                ))
                .await?;
        }
        Ok(())
    }

    /// Closes the command's stdin (EOF for the process).
    pub async fn close_stdin(&mut self) -> Result<(), AgentError> {
        self.client
            .send_req(self.call.id, &Request::StdinClose {})
            .await
    }

    /// Sends signal `sig` to the command's process group.
    pub async fn signal(&mut self, sig: i32) -> Result<(), AgentError> {
        self.client
            .send_req(self.call.id, &Request::Signal { signal: sig })
            .await
    }
}

fn broken_pipe() -> AgentError {
    AgentError::Io(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "command has ended; stdin is closed",
    ))
}

/// A streaming download from the guest.
pub struct FileDownload {
    client: AgentClient,
    call: Call,
    size: u64,
    consumed: u64,
    done: bool,
}

impl std::fmt::Debug for FileDownload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDownload")
            .field("size", &self.size)
            .field("consumed", &self.consumed)
            .finish()
    }
}

impl FileDownload {
    /// File size when the agent opened it.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Next chunk; `None` at the end.
    pub async fn next_chunk(&mut self) -> Option<Result<Bytes, AgentError>> {
        if self.done {
            return None;
        }
        loop {
            match self.call.recv().await {
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
                Ok(Incoming::Data(FrameKind::FileData, b)) => {
                    self.consumed += b.len() as u64;
                    let ack = Request::ReadAck {
                        bytes: self.consumed,
                    };
                    if let Err(e) = self.client.send_req(self.call.id, &ack).await {
                        self.done = true;
                        return Some(Err(e));
                    }
                    return Some(Ok(b));
                }
                Ok(Incoming::Data(..)) => {}
                Ok(Incoming::Msg(Response::Done { .. })) => {
                    self.done = true;
                    return None;
                }
                Ok(Incoming::Msg(Response::Error { kind, message })) => {
                    self.done = true;
                    return Some(Err(remote(kind, message)));
                }
                Ok(Incoming::Msg(r)) => {
                    self.done = true;
                    return Some(Err(unexpected(&r)));
                }
            }
        }
    }

    /// Copies the whole file into `w`; returns the byte count.
    pub async fn copy_to<W: AsyncWrite + Unpin>(mut self, w: &mut W) -> Result<u64, AgentError> {
        let mut n = 0;
        while let Some(chunk) = self.next_chunk().await {
            let chunk = chunk?;
            w.write_all(&chunk).await?;
            n += chunk.len() as u64;
        }
        w.flush().await?;
        Ok(n)
    }

    /// The download as a `Stream` of chunks.
    pub fn into_stream(self) -> impl Stream<Item = Result<Bytes, AgentError>> + Send {
        futures::stream::unfold(
            self,
            |mut d| async move { d.next_chunk().await.map(|r| (r, d)) },
        )
    }

    /// The download as an `AsyncRead`.
    pub fn into_async_read(self) -> impl AsyncRead + Send {
        use futures::TryStreamExt;
        tokio_util::io::StreamReader::new(Box::pin(
            self.into_stream().map_err(std::io::Error::other),
        ))
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
) {
    let mut buf = vec![0u8; 256 * 1024];
    'outer: loop {
        loop {
            match dec.next_item() {
                Ok(None) => break,
                Ok(Some(Decoded::Sync)) => {}
                Ok(Some(Decoded::Frame(f))) => {
                    if !route(&shared, &out, f) {
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
fn route(shared: &Arc<Shared>, out: &mpsc::Sender<Bytes>, f: Frame) -> bool {
    if is_tunnel_id(f.id) {
        return route_tunnel(shared, out, f);
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

/// Routes one frame of an agent-opened tunnel; `false` if the connection must close.
fn route_tunnel(shared: &Arc<Shared>, out: &mpsc::Sender<Bytes>, f: Frame) -> bool {
    let id = f.id;
    let msg = match f.kind {
        FrameKind::Tunnel => TunnelMsg::Data(f.payload),
        FrameKind::Control => match f.parse::<Response>() {
            Ok(Response::TunnelOpen { peer }) => {
                open_tunnel(shared.clone(), out.clone(), id, peer);
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
fn open_tunnel(shared: Arc<Shared>, out: mpsc::Sender<Bytes>, id: u32, peer: String) {
    let Some(handler) = shared.egress else {
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
            if shared.closed.load(Ordering::SeqCst) {
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
