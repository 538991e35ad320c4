//! Running commands in the guest: [`AgentClient::exec`] and the
//! [`ExecHandle`] that streams a command's events.
//!
//! Contract (see `PROTOCOL.md`, *Requests*): the client sends `exec` on a
//! fresh id; the agent answers `started {pid}`, then Stdout/Stderr frames in
//! any interleaving, then `exit {code, signal, timed_out}` as the last message
//! — or `error` (spawn failed, bad argument) instead. Stdin goes as Stdin data
//! frames of at most [`STDIN_CHUNK`] bytes, at most [`STDIN_WINDOW`] bytes not
//! yet acknowledged by the agent's cumulative `ack {bytes}`; `stdin_close`
//! ends it, `signal` signals the command's process group.
//!
//! Command output is windowed when the connection negotiated it
//! ([`AgentClient::output_window`]): the agent has at most [`OUTPUT_WINDOW`]
//! bytes of stdout and stderr together sent and not yet acknowledged; the
//! handle acknowledges (`output_ack {bytes}`, cumulative) what its caller has
//! taken, at least every [`OUTPUT_ACK_EVERY`] bytes. A caller that stops
//! reading therefore stops the command's pipes, not the host's memory. An
//! agent that sends beyond the window loses that command
//! ([`AgentError::FlowControl`], process group killed). Dropping a handle
//! before the exit tells the agent to discard the rest (`output_discard`):
//! the command runs on. With an older agent the handle's queue is capped
//! instead ([`super::CALL_BUFFER_CAP`]). `Stdin::Bytes` is fed while the
//! caller reads events, so a command that writes before it has read all its
//! input cannot deadlock against its own output window.
//!
//! A command may run on a pseudo-terminal ([`ExecRequest::pty`]): its output
//! then arrives as `Stdout` only (the terminal merges the streams), stdin is
//! always a stream (written to the terminal, so `^C` interrupts it),
//! [`ExecHandle::resize`] changes its window size. An agent older than PTYs
//! rejects such an exec; the handle reports [`AgentError::Unsupported`].
//! [`ExecHandle::interactive`] turns a handle into an event stream plus an
//! input channel ([`ExecInput`]) for callers that drive it from elsewhere.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use tokio::sync::mpsc;

use super::demux::{send_detached, Call, Incoming, Limits};
use super::{remote, unexpected, AgentClient, AgentError};
use crate::frame::{Frame, FrameKind};
use crate::msg::{Command, PtySize, RemoteErrorKind, Request, Response};

/// Unacknowledged stdin bytes the client may have in flight.
pub const STDIN_WINDOW: u64 = 1024 * 1024;
/// Size of one stdin data frame.
pub const STDIN_CHUNK: usize = 64 * 1024;
/// Command output (stdout and stderr together) the agent may have in flight
/// per command, when the connection negotiated output flow control.
pub const OUTPUT_WINDOW: u64 = 1024 * 1024;
/// The handle acknowledges consumed output at least every this many bytes.
pub const OUTPUT_ACK_EVERY: u64 = OUTPUT_WINDOW / 4;
/// Most output (stdout and stderr together) [`AgentClient::exec_collect`]
/// collects before it kills the command and fails with
/// [`AgentError::OutputLimit`].
pub const COLLECT_LIMIT: u64 = 16 * 1024 * 1024;

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
    /// Run on a pseudo-terminal of this size (stdin becomes a stream
    /// whatever [`ExecRequest::stdin`] says; `Bytes` are fed first).
    pub pty: Option<PtySize>,
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
            pty: None,
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

impl AgentClient {
    /// Starts a command. Spawn failures arrive as the first event
    /// (`Err(Remote{SpawnFailed|NotFound|...})`).
    pub async fn exec(&self, req: ExecRequest) -> Result<ExecHandle, AgentError> {
        let window = self.output_window();
        let call = self.inner.shared.open_with(Limits {
            window,
            kill_on_abort: true,
        })?;
        let wire = Request::Exec {
            command: req.command,
            env: req.env,
            cwd: req.cwd,
            user: req.user,
            stdin: !matches!(req.stdin, Stdin::Null),
            timeout_ms: req
                .timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            pty: req.pty,
        };
        self.send_req(call.id, &wire).await?;
        let feed = match req.stdin {
            Stdin::Bytes(data) => Some(Bytes::from(data)),
            _ => None,
        };
        let mut h = ExecHandle {
            client: self.clone(),
            call,
            stdin_sent: 0,
            stdin_acked: 0,
            feed,
            finished: false,
            windowed: window.is_some(),
            consumed: 0,
            acked_out: 0,
            pty: req.pty.is_some(),
            started: false,
        };
        h.feed_stdin().await?;
        Ok(h)
    }

    /// Runs a command to the end and collects its output, at most
    /// [`COLLECT_LIMIT`] bytes of it.
    pub async fn exec_collect(&self, req: ExecRequest) -> Result<ExecOutput, AgentError> {
        self.exec_collect_max(req, COLLECT_LIMIT).await
    }

    /// Runs a command to the end and collects its output; more than `limit`
    /// bytes (stdout and stderr together) kill the command and fail with
    /// [`AgentError::OutputLimit`].
    pub async fn exec_collect_max(
        &self,
        req: ExecRequest,
        limit: u64,
    ) -> Result<ExecOutput, AgentError> {
        let mut h = self.exec(req).await?;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        while let Some(ev) = h.next_event().await {
            let ev = ev?;
            if let ExecEvent::Stdout(b) | ExecEvent::Stderr(b) = &ev {
                if (stdout.len() + stderr.len() + b.len()) as u64 > limit {
                    let _ = h.signal(9).await;
                    return Err(AgentError::OutputLimit { limit });
                }
            }
            match ev {
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
}

/// A running command.
pub struct ExecHandle {
    client: AgentClient,
    call: Call,
    stdin_sent: u64,
    stdin_acked: u64,
    /// `Stdin::Bytes` not sent yet (fed while events are read).
    feed: Option<Bytes>,
    finished: bool,
    /// The agent windows this command's output.
    windowed: bool,
    /// Output bytes returned to the caller.
    consumed: u64,
    /// Output bytes acknowledged to the agent.
    acked_out: u64,
    /// The command was asked to run on a PTY.
    pty: bool,
    /// `started` was seen.
    started: bool,
}

/// Input to a running command driven through [`ExecHandle::interactive`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecInput {
    /// Bytes for its stdin (its terminal, on a PTY).
    Stdin(Bytes),
    /// End of its stdin.
    CloseStdin,
    /// New window size of its PTY (ignored without one).
    Resize(PtySize),
    /// A signal for its process group.
    Signal(i32),
}

/// Queue depth of an interactive command's input channel.
pub const INPUT_QUEUE: usize = 64;

/// Events of an interactive command ([`ExecHandle::interactive`]).
pub type EventStream = BoxStream<'static, Result<ExecEvent, AgentError>>;

/// What [`ExecHandle::interactive`] keeps between events.
struct Interactive {
    h: ExecHandle,
    rx: Option<mpsc::Receiver<ExecInput>>,
    /// Stdin taken from the channel, not sent yet.
    pending: std::collections::VecDeque<Bytes>,
    pending_bytes: u64,
    /// Close stdin once `pending` is sent.
    close: bool,
}

impl Interactive {
    /// Sends pending stdin as far as the stdin window allows (never waits
    /// for an ack), then the close if one is due.
    async fn flush(&mut self) -> Result<(), AgentError> {
        if self.h.ended() {
            self.pending.clear();
            self.pending_bytes = 0;
            return Ok(());
        }
        while let Some(front) = self.pending.front_mut() {
            let room = STDIN_WINDOW.saturating_sub(self.h.stdin_sent - self.h.stdin_acked);
            if room == 0 {
                break;
            }
            let n = front.len().min(STDIN_CHUNK).min(room as usize);
            let chunk = front.split_to(n);
            if front.is_empty() {
                self.pending.pop_front();
            }
            self.pending_bytes -= n as u64;
            self.h.send_stdin(chunk).await?;
        }
        if self.close && self.pending.is_empty() {
            self.close = false;
            self.h.close_stdin().await?;
        }
        Ok(())
    }
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
            let inc = self.recv_incoming().await;
            if let Some(ev) = self.handle(inc).await {
                return Some(ev);
            }
        }
    }

    /// The next frame of the command (feeding `Stdin::Bytes` meanwhile).
    /// Cancel-safe once the feed is sent.
    async fn recv_incoming(&mut self) -> Result<Incoming, AgentError> {
        self.feed_stdin().await?;
        self.call.recv().await
    }

    /// What frame `inc` means for the caller (`None`: nothing to report).
    async fn handle(
        &mut self,
        inc: Result<Incoming, AgentError>,
    ) -> Option<Result<ExecEvent, AgentError>> {
        {
            let inc = match inc {
                Ok(i) => i,
                Err(e) => {
                    self.finished = true;
                    return Some(Err(e));
                }
            };
            match inc {
                Incoming::Data(kind @ (FrameKind::Stdout | FrameKind::Stderr), b) => {
                    if let Err(e) = self.consumed(b.len()).await {
                        self.finished = true;
                        return Some(Err(e));
                    }
                    return Some(Ok(if kind == FrameKind::Stdout {
                        ExecEvent::Stdout(b)
                    } else {
                        ExecEvent::Stderr(b)
                    }));
                }
                Incoming::Data(..) => {}
                Incoming::Msg(Response::Ack { bytes }) => {
                    self.stdin_acked = self.stdin_acked.max(bytes)
                }
                Incoming::Msg(Response::Started { pid }) => {
                    self.started = true;
                    return Some(Ok(ExecEvent::Started { pid }));
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
                    if self.pty && !self.started && rejects_pty(kind, &message) {
                        return Some(Err(AgentError::Unsupported { feature: "PTYs" }));
                    }
                    return Some(Err(remote(kind, message)));
                }
                Incoming::Msg(r) => {
                    self.finished = true;
                    return Some(Err(unexpected(&r)));
                }
            }
        }
        None
    }

    /// Whether the command runs on a PTY (it was asked to).
    pub fn is_pty(&self) -> bool {
        self.pty
    }

    /// Sets the window size of the command's PTY; a no-op for a command
    /// without one (an agent older than PTYs never sees the request).
    pub async fn resize(&mut self, size: PtySize) -> Result<(), AgentError> {
        if !self.pty || self.ended() {
            return Ok(());
        }
        let r = Request::Resize {
            cols: size.cols,
            rows: size.rows,
        };
        self.client.send_req(self.call.id, &r).await
    }

    /// Drives the command from a task: its events come from the stream
    /// (ending after `Exit` or an error), its input goes into the sender
    /// ([`INPUT_QUEUE`] deep). Stdin input needs `Stdin::Stream` or a PTY;
    /// dropping the sender closes stdin, dropping the stream discards the
    /// rest of the output (the command runs on unless signalled).
    ///
    /// Stdin is sent as the stdin window allows while events keep being
    /// read (a command that echoes a large paste cannot deadlock its own
    /// output against its input); at most [`STDIN_WINDOW`] bytes wait here
    /// before the sender is held up.
    pub fn interactive(self) -> (EventStream, mpsc::Sender<ExecInput>) {
        let (tx, rx) = mpsc::channel(INPUT_QUEUE);
        let state = Interactive {
            h: self,
            rx: Some(rx),
            pending: std::collections::VecDeque::new(),
            pending_bytes: 0,
            close: false,
        };
        let stream = futures::stream::unfold(state, |mut st| async move {
            loop {
                if st.h.finished {
                    return None;
                }
                if let Err(e) = st.flush().await {
                    st.h.finished = true;
                    return Some((Err(e), st));
                }
                let room = st.pending_bytes < STDIN_WINDOW;
                let input = async {
                    match st.rx.as_mut() {
                        Some(r) if room => r.recv().await,
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    // Both arms are cancel-safe; the work is done in the bodies.
                    inc = st.h.recv_incoming() => {
                        if let Some(ev) = st.h.handle(inc).await {
                            return Some((ev, st));
                        }
                    }
                    i = input => {
                        let r = match i {
                            Some(ExecInput::Stdin(b)) => {
                                if !b.is_empty() {
                                    st.pending_bytes += b.len() as u64;
                                    st.pending.push_back(b);
                                }
                                Ok(())
                            }
                            Some(ExecInput::CloseStdin) | None => {
                                st.rx = None;
                                st.close = true;
                                Ok(())
                            }
                            Some(ExecInput::Resize(s)) => st.h.resize(s).await,
                            Some(ExecInput::Signal(s)) => st.h.signal(s).await,
                        };
                        if let Err(e) = r {
                            st.h.finished = true;
                            return Some((Err(e), st));
                        }
                    }
                }
            }
        });
        (Box::pin(stream), tx)
    }

    /// The caller took `n` more output bytes: acknowledge them when due.
    async fn consumed(&mut self, n: usize) -> Result<(), AgentError> {
        if !self.windowed {
            return Ok(());
        }
        self.consumed += n as u64;
        if self.consumed - self.acked_out >= OUTPUT_ACK_EVERY {
            // Recorded before sending: the agent may use the credit at once.
            self.call.grant(self.consumed);
            self.acked_out = self.consumed;
            let ack = Request::OutputAck {
                bytes: self.consumed,
            };
            self.client.send_req(self.call.id, &ack).await?;
        }
        Ok(())
    }

    /// Sends as much of the `Stdin::Bytes` input as the stdin window allows
    /// (never waits for an ack); closes stdin after the last byte.
    async fn feed_stdin(&mut self) -> Result<(), AgentError> {
        let Some(mut data) = self.feed.take() else {
            return Ok(());
        };
        if self.ended() {
            return Ok(()); // like a broken pipe: the rest is not wanted
        }
        while !data.is_empty() && self.stdin_sent - self.stdin_acked < STDIN_WINDOW {
            let chunk = data.split_to(data.len().min(STDIN_CHUNK));
            self.send_stdin(chunk).await?;
        }
        if data.is_empty() {
            self.close_stdin().await
        } else {
            self.feed = Some(data);
            Ok(())
        }
    }

    async fn send_stdin(&mut self, chunk: Bytes) -> Result<(), AgentError> {
        self.stdin_sent += chunk.len() as u64;
        self.client
            .send_frame(Frame::data(FrameKind::Stdin, self.call.id, chunk))
            .await
    }

    /// Whether the exit (or a terminal error) was seen, queued or consumed.
    fn ended(&self) -> bool {
        self.finished || self.call.has_msg(is_terminal)
    }

    /// Writes to the command's stdin (requires `Stdin::Stream`).
    /// Waits when the agent has not consumed the previous bytes yet; fails with
    /// a `BrokenPipe` I/O error once the command has ended. Output that
    /// arrives meanwhile stays queued for [`ExecHandle::next_event`]; with a
    /// windowed agent a command that writes more than [`OUTPUT_WINDOW`]
    /// before reading the rest of its input waits for the caller to read.
    pub async fn write_stdin(&mut self, data: &[u8]) -> Result<(), AgentError> {
        for chunk in data.chunks(STDIN_CHUNK) {
            while self.stdin_sent - self.stdin_acked >= STDIN_WINDOW {
                if self.ended() {
                    return Err(broken_pipe());
                }
                let ack = |r: &Response| matches!(r, Response::Ack { .. });
                match self.call.take_msg(ack, is_terminal).await? {
                    Some(Response::Ack { bytes }) => self.stdin_acked = self.stdin_acked.max(bytes),
                    _ => return Err(broken_pipe()),
                }
            }
            if self.ended() {
                return Err(broken_pipe());
            }
            self.send_stdin(Bytes::copy_from_slice(chunk)).await?;
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

impl Drop for ExecHandle {
    fn drop(&mut self) {
        // Nobody reads the rest: the command runs on, its output is dropped
        // in the guest instead of waiting for credit forever.
        if self.windowed && !self.ended() {
            send_detached(
                &self.client.inner.out,
                self.call.id,
                &Request::OutputDiscard {},
            );
        }
    }
}

/// Whether an agent's answer to a PTY exec says it does not know PTYs: an
/// agent older than them cannot parse an `exec` with the `pty` field and
/// fails the request as a bad request (`invalid control message`); a
/// newer one parses every `exec` this client sends.
fn rejects_pty(kind: RemoteErrorKind, message: &str) -> bool {
    kind == RemoteErrorKind::InvalidArgument && message.starts_with("bad request")
}

fn is_terminal(r: &Response) -> bool {
    matches!(r, Response::Exit { .. } | Response::Error { .. })
}

fn broken_pipe() -> AgentError {
    AgentError::Io(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "command has ended; stdin is closed",
    ))
}
