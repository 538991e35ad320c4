//! Wire protocol between the host and the strata guest agent: framing, messages, and the async host-side client.
//!
//! See `PROTOCOL.md` in this crate for the wire format.

pub mod client;
pub mod frame;
pub mod msg;
pub mod tunnel;

pub use client::{
    AgentClient, AgentError, DirWatch, ExecEvent, ExecHandle, ExecInput, ExecOutput, ExecRequest,
    ExitStatus, FileDownload, HandshakeStats, Liveness, PortOpens, Stdin, TunnelHandler,
    WatchBatch,
};
pub use frame::{decode_frame, Decoded, Frame, FrameDecoder, FrameError, FrameKind};
pub use msg::{
    AgentInfo, Command, DirEntry, EntryExt, FileKind, FileStat, PtySize, RemoteErrorKind, Request,
    Response, RestoreSync, WatchEvent, WatchKind, MAX_WATCH_BATCH, MAX_WATCH_WAIT_MS,
    MAX_XATTR_BYTES,
};

/// Version of the wire protocol; host and agent must agree.
pub const PROTOCOL_VERSION: u32 = 1;
