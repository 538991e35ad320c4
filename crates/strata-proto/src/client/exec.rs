//! Running commands in the guest: [`AgentClient::exec`] and the
//! [`ExecHandle`] that streams a command's events.
//!
//! Contract (see `PROTOCOL.md`, *Requests*): the client sends `exec` on a
//! fresh id; the agent answers `started {pid}`, then Stdout/Stderr frames in
//! any interleaving, then `exit {code, signal, timed_out}` as the last message
//! — or `error` (spawn failed, bad argument) instead. Stdin goes as Stdin data
//! frames of at most [`STDIN_CHUNK`] bytes, at most [`STDIN_WINDOW`] bytes not
//! yet acknowledged by the agent's cumulative `ack {bytes}`; `stdin_close`
//! ends it, `signal` signals the command's process group. Command output has
//! no window: the client buffers what the caller has not read yet.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use super::demux::{Call, Incoming};
use super::{remote, unexpected, AgentClient, AgentError};
use crate::frame::{Frame, FrameKind};
use crate::msg::{Command, Request, Response};

/// Unacknowledged stdin bytes the client may have in flight.
pub const STDIN_WINDOW: u64 = 1024 * 1024;
/// Size of one stdin data frame.
pub const STDIN_CHUNK: usize = 64 * 1024;

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

impl AgentClient {
    /// Starts a command. Spawn failures arrive as the first event
    /// (`Err(Remote{SpawnFailed|NotFound|...})`).
    pub async fn exec(&self, req: ExecRequest) -> Result<ExecHandle, AgentError> {
        let call = self.inner.shared.open()?;
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
}

/// A running command.
pub struct ExecHandle {
    client: AgentClient,
    call: Call,
    /// Frames read while waiting for a stdin ack, not yet returned as events.
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
