//! Files in the guest: streaming upload ([`AgentClient::write_file`]) and
//! download ([`FileDownload`]) with bounded memory on both sides, and the
//! one-reply operations list, stat, mkdir -p and remove.
//!
//! Contract (see `PROTOCOL.md`, *Requests*):
//!
//! - Upload: `write_file {path, mode}`, FileData frames of at most
//!   [`MAX_FILE_CHUNK`] bytes, then `write_end`. The agent acknowledges each
//!   written chunk with a cumulative `ack {bytes}`; the client keeps at most
//!   [`WRITE_WINDOW`] bytes unacknowledged. The agent writes a temporary file
//!   beside `path` and renames it into place at `write_end` (`done {bytes}`);
//!   on `error`, or when the client goes away, nothing is left behind.
//! - Download: `read_file {path}` → `file_start {size}`, FileData frames,
//!   `done {bytes}`; the client answers each chunk with a cumulative
//!   `read_ack {bytes}` and the agent keeps at most [`WRITE_WINDOW`] bytes
//!   unacknowledged before it sends its next chunk. A download the agent
//!   sends beyond that (plus one chunk) fails with
//!   [`AgentError::FlowControl`]; the connection stays up.
//! - Paths are absolute and free of NUL bytes (the agent checks).

use bytes::{Bytes, BytesMut};
use futures::Stream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::demux::{send_detached, Call, Incoming, Limits};
use super::{remote, unexpected, AgentClient, AgentError};
use crate::frame::{Frame, FrameKind, MAX_FILE_CHUNK};
use crate::msg::{DirEntry, FileStat, Request, Response};

/// Unacknowledged upload bytes the client may have in flight.
pub const WRITE_WINDOW: u64 = 16 * MAX_FILE_CHUNK as u64;

impl AgentClient {
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
        let mut call = self.inner.shared.open()?;
        self.send_req(
            call.id,
            &Request::WriteFile {
                path: path.to_owned(),
                mode,
            },
        )
        .await?;
        // Until the agent has answered `done` or `error`, leaving this
        // function (an error of the source or the connection, or the caller
        // dropping the future) abandons the upload in the guest too.
        let mut abandon = Abandon {
            out: &self.inner.out,
            id: call.id,
            armed: true,
        };
        let mut sent: u64 = 0;
        let mut acked: u64 = 0;
        let mut eof = false;
        while !eof {
            // Pick up early errors and acks without blocking.
            while let Some(inc) = call.try_recv()? {
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
                Response::Done { bytes } => {
                    abandon.armed = false;
                    return Ok(bytes);
                }
                Response::Error { kind, message } => {
                    abandon.armed = false;
                    return Err(remote(kind, message));
                }
                r => return Err(unexpected(&r)),
            }
        }
    }

    /// Opens `path` in the guest for streaming download.
    pub async fn read_file(&self, path: &str) -> Result<FileDownload, AgentError> {
        // Every agent keeps a download within WRITE_WINDOW before it sends
        // its next chunk, so one chunk may pass it.
        let mut call = self.inner.shared.open_with(Limits {
            window: Some(WRITE_WINDOW + MAX_FILE_CHUNK as u64),
            kill_on_abort: false,
        })?;
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

    /// Replaces the attributes of `path` named `prefix…` by `set` (see
    /// [`Request::SetXattrs`]); an agent that predates the op answers
    /// [`AgentError::Unsupported`].
    pub async fn set_xattrs(
        &self,
        path: &str,
        prefix: &str,
        set: std::collections::BTreeMap<String, String>,
    ) -> Result<(), AgentError> {
        let req = Request::SetXattrs {
            path: path.to_owned(),
            prefix: prefix.to_owned(),
            set,
        };
        match self.call(&req).await {
            Ok(Response::Ok) => Ok(()),
            Ok(r) => Err(unexpected(&r)),
            Err(AgentError::Remote {
                kind: crate::msg::RemoteErrorKind::InvalidArgument,
                message,
            }) if message.starts_with("bad request:") => Err(AgentError::Unsupported {
                feature: "extended attributes",
            }),
            Err(e) => Err(e),
        }
    }

    /// Removes a file, symlink or (empty, or with `recursive` any) directory.
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        self.expect_ok(&Request::Remove {
            path: path.to_owned(),
            recursive,
        })
        .await
    }
}

/// Sends `write_abort` for an upload left before the agent answered it
/// (see [`AgentClient::write_file`]).
struct Abandon<'a> {
    out: &'a tokio::sync::mpsc::Sender<Bytes>,
    id: u32,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            send_detached(self.out, self.id, &Request::WriteAbort {});
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
                    // Recorded before sending: the agent may use the credit at once.
                    self.call.grant(self.consumed);
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
