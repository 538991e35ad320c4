//! Control messages (JSON payloads of [`crate::frame::FrameKind::Control`] frames).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Host → agent control messages. The frame id names the request they belong to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Starts a session; always preceded by [`crate::frame::SYNC_MAGIC`].
    Hello {
        /// Host's protocol version.
        version: u32,
        /// Random per-connection nonce, echoed in the reply.
        nonce: u64,
    },
    /// Liveness check; answered with [`Response::Pong`].
    Ping {},
    /// Starts a command.
    Exec {
        /// What to run.
        command: Command,
        /// Extra environment variables.
        #[serde(default)]
        env: BTreeMap<String, String>,
        /// Working directory (absolute).
        #[serde(default)]
        cwd: Option<String>,
        /// User name or numeric uid to run as.
        #[serde(default)]
        user: Option<String>,
        /// Whether stdin is a pipe fed by `Stdin` frames (else /dev/null).
        #[serde(default)]
        stdin: bool,
        /// Kill the process group after this many milliseconds.
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// Run on a new pseudo-terminal of this size: stdin, stdout and
        /// stderr are its slave (the command's controlling terminal), output
        /// comes as `Stdout` frames, `Stdin` frames go to the terminal.
        /// Absent: pipes, and the message is byte-for-byte what it was
        /// before PTYs (an older agent rejects the field: no PTY support).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pty: Option<PtySize>,
    },
    /// Sets the window size of the command's pseudo-terminal (on the exec's
    /// id; the foreground process group gets `SIGWINCH`). No reply; ignored
    /// for a command without a PTY.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
    /// Closes the command's stdin.
    StdinClose {},
    /// Sends a signal to the command's process group.
    Signal {
        /// Signal number.
        signal: i32,
    },
    /// Starts an upload; `FileData` frames follow, then [`Request::WriteEnd`].
    WriteFile {
        /// Absolute destination path.
        path: String,
        /// Permission bits (default 0o644).
        #[serde(default)]
        mode: Option<u32>,
    },
    /// Ends an upload.
    WriteEnd {},
    /// Abandons an upload (on its id): the agent removes the temporary file
    /// and forgets the request, with no reply. The host sends it when it gives
    /// up on an upload before `write_end` (its source failed, was over a
    /// limit, or its caller went away). An agent older than this op answers
    /// `invalid_argument` (ignored: the host's call is gone) and keeps the
    /// file until its session ends, as before.
    WriteAbort {},
    /// Starts a download; answered with `FileStart`, `FileData` frames, `Done`.
    ReadFile {
        /// Absolute path.
        path: String,
    },
    /// Download flow control: total bytes the host has consumed.
    ReadAck {
        /// Cumulative byte count.
        bytes: u64,
    },
    /// Lists a directory.
    ListDir {
        /// Absolute path.
        path: String,
    },
    /// Stats a path (lstat semantics).
    Stat {
        /// Absolute path.
        path: String,
    },
    /// `mkdir -p`.
    MkdirAll {
        /// Absolute path.
        path: String,
        /// Permission bits for created directories (default 0o755).
        #[serde(default)]
        mode: Option<u32>,
    },
    /// Removes a file, symlink or directory.
    Remove {
        /// Absolute path.
        path: String,
        /// Remove directory contents too.
        #[serde(default)]
        recursive: bool,
    },
    /// Replaces the `user.` extended attributes of `path` whose names
    /// start with `prefix` by `set` (names are full, e.g. `user.e2b.tag`;
    /// each must start with `prefix`, and `prefix` with `user.`): answered
    /// with [`Response::Ok`]. Symlinks are not followed. An older agent
    /// answers `invalid_argument` (the op is unknown to it).
    SetXattrs {
        /// Absolute path.
        path: String,
        /// The namespace replaced, e.g. `user.e2b.`.
        prefix: String,
        /// Attributes to set (name → value).
        #[serde(default)]
        set: BTreeMap<String, String>,
    },
    /// Post-restore fork-safety fixups.
    RestoreSync(RestoreSync),
    /// Turns egress on for this session: the agent listens for guest
    /// connections (binding its listener on first use) and forwards each one
    /// as a tunnel (answered with [`Response::EgressEnabled`]). Lapses when
    /// the session ends.
    EgressEnable {},
    /// Turns on flow control of command output for this session (answered
    /// with [`Response::Ok`]; an older agent answers `invalid_argument`):
    /// from now on every command's stdout and stderr together have at most
    /// `bytes` sent and not yet acknowledged with [`Request::OutputAck`].
    /// Lapses when the session ends.
    OutputWindow {
        /// Window size in bytes (> 0).
        bytes: u64,
    },
    /// Command output flow control: total stdout + stderr bytes the host
    /// has consumed of this command (on the exec's id).
    OutputAck {
        /// Cumulative byte count.
        bytes: u64,
    },
    /// The host no longer wants this command's output: the agent keeps
    /// reading the command's pipes and drops what it reads (the command runs
    /// on, its window no longer applies). No reply.
    OutputDiscard {},
    /// Tunnel accepted: the host reached the egress target; data may flow.
    TunnelOk {},
    /// Tunnel flow control: total tunnel bytes the host has written out.
    TunnelAck {
        /// Cumulative byte count.
        bytes: u64,
    },
    /// The host's side of the tunnel has no more data (half-close).
    TunnelEof {},
    /// Aborts the tunnel (or refuses it, as the answer to
    /// [`Response::TunnelOpen`]). No reply.
    TunnelClose {
        /// Why, if it is a failure.
        #[serde(default)]
        error: Option<String>,
    },
    /// Opens a port tunnel (host-initiated, on a host-chosen id with
    /// [`crate::tunnel::TUNNEL_ID_BIT`] and [`crate::tunnel::PORT_ID_BIT`]
    /// set): the agent connects to `127.0.0.1:<port>` in the guest and
    /// answers [`Response::PortConnected`], then both ends pump the tunnel as
    /// egress tunnels do; or it answers `error` (`not_found`: nothing
    /// listens). An older agent answers `invalid_argument`: no port tunnels.
    PortConnect {
        /// Guest TCP port on the loopback address (> 0).
        port: u16,
    },
    /// Starts watching directory `path` with inotify (and, with
    /// `recursive`, every directory below it, new ones as they appear):
    /// answered with [`Response::WatchStarted`]; the watch lives on this id
    /// until [`Request::WatchStop`] or the session ends. An older agent
    /// answers `invalid_argument` (`bad request: …`, the op is unknown).
    Watch {
        /// Absolute path of a directory.
        path: String,
        /// Watch the whole tree below `path`.
        #[serde(default)]
        recursive: bool,
    },
    /// On a watch's id: the events buffered since the last poll, answered
    /// with [`Response::WatchEvents`]. With `wait_ms` and nothing buffered
    /// the agent answers when the first event comes or after that long (at
    /// most [`MAX_WATCH_WAIT_MS`]). The agent reads the kernel's queue first,
    /// so a poll sent after a file operation returned sees its events.
    WatchPoll {
        /// Longest wait for a first event, in milliseconds (0: none).
        #[serde(default)]
        wait_ms: u64,
    },
    /// Ends the watch on this id (its inotify instance is closed). No reply.
    WatchStop {},
}

/// Agent → host control messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// Session accepted; preceded by [`crate::frame::SYNC_MAGIC`].
    HelloOk {
        /// Nonce from the Hello.
        nonce: u64,
        /// Who answered.
        info: AgentInfo,
    },
    /// Session refused: the versions differ. Preceded by the sync marker.
    VersionMismatch {
        /// Nonce from the Hello.
        nonce: u64,
        /// Version the host asked for.
        host_version: u32,
        /// Version the agent speaks.
        agent_version: u32,
    },
    /// Answer to [`Request::Ping`].
    Pong {
        /// Current agent facts.
        info: AgentInfo,
    },
    /// Command started.
    Started {
        /// Process id in the guest (also its process group id).
        pid: u32,
    },
    /// Command finished; last message for its id.
    Exit {
        /// Exit code, if it exited.
        code: Option<i32>,
        /// Terminating signal, if killed.
        signal: Option<i32>,
        /// Killed because its timeout expired.
        timed_out: bool,
    },
    /// Upload / stdin flow control: total bytes consumed so far.
    Ack {
        /// Cumulative byte count.
        bytes: u64,
    },
    /// Download starts.
    FileStart {
        /// File size at open time.
        size: u64,
    },
    /// Upload or download finished.
    Done {
        /// Bytes transferred.
        bytes: u64,
    },
    /// Directory listing.
    Listing {
        /// Entries sorted by name.
        entries: Vec<DirEntry>,
    },
    /// Stat result (`None`: no such path).
    Stat {
        /// Result.
        stat: Option<FileStat>,
    },
    /// Success without data.
    Ok,
    /// Answer to [`Request::EgressEnable`]: where guest programs connect.
    EgressEnabled {
        /// Bound listen address in the guest, e.g. `127.0.0.1:3128`.
        listen: String,
    },
    /// A guest program connected to the egress listener; the id (high bit
    /// set) names the new tunnel. The host answers [`Request::TunnelOk`] or
    /// [`Request::TunnelClose`].
    TunnelOpen {
        /// The guest-side peer address (for logs).
        #[serde(default)]
        peer: String,
    },
    /// Tunnel flow control: total tunnel bytes the agent has written out.
    TunnelAck {
        /// Cumulative byte count.
        bytes: u64,
    },
    /// The guest side of the tunnel has no more data (half-close).
    TunnelEof {},
    /// Aborts the tunnel. No reply.
    TunnelClose {
        /// Why, if it is a failure.
        #[serde(default)]
        error: Option<String>,
    },
    /// Answer to [`Request::PortConnect`]: the guest port accepted the
    /// connection; tunnel data may flow both ways.
    PortConnected {},
    /// Answer to [`Request::Watch`]: the directory is watched.
    WatchStarted {
        /// Directories watched (1 without recursion).
        dirs: u32,
    },
    /// Answer to [`Request::WatchPoll`]: events in the order the kernel
    /// reported them, oldest first, at most [`MAX_WATCH_BATCH`].
    WatchEvents {
        /// The events.
        events: Vec<WatchEvent>,
        /// More are buffered: poll again.
        #[serde(default)]
        more: bool,
    },
    /// Request failed; last message for its id. Id 0: protocol error, the
    /// agent dropped out of sync and the host must reconnect.
    Error {
        /// Category.
        kind: RemoteErrorKind,
        /// Human-readable detail.
        message: String,
    },
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Program and arguments, looked up in `PATH`.
    Argv(Vec<String>),
    /// A string for `/bin/sh -c`.
    Shell(String),
}

/// Window size of a pseudo-terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// Longest `wait_ms` a [`Request::WatchPoll`] may ask for.
pub const MAX_WATCH_WAIT_MS: u64 = 30_000;
/// Most events one [`Response::WatchEvents`] carries.
pub const MAX_WATCH_BATCH: usize = 512;

/// What happened to a watched path, as fsnotify (and so envd) names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    /// Created or moved in (`IN_CREATE`, `IN_MOVED_TO`).
    Create,
    /// Written (`IN_MODIFY`).
    Write,
    /// Removed (`IN_DELETE`; `IN_DELETE_SELF` of the watched directory).
    Remove,
    /// Moved away (`IN_MOVED_FROM`).
    Rename,
    /// Metadata changed: mode, owner, times (`IN_ATTRIB`).
    Chmod,
    /// Events were lost here (the agent's buffer or the kernel's queue
    /// was full); `name` is empty.
    Overflow,
    /// A kind this host does not know (a newer agent).
    #[serde(other)]
    Other,
}

/// One event of a watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// Path relative to the watched directory (`sub/file`; empty for the
    /// directory itself), lossy UTF-8.
    pub name: String,
    /// What happened.
    pub kind: WatchKind,
    /// The path is a directory (`IN_ISDIR`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dir: bool,
}

/// Agent facts returned by the handshake and by ping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Protocol version the agent speaks.
    pub protocol_version: u32,
    /// Agent build (crate) version.
    pub agent_version: String,
    /// Guest hostname.
    pub hostname: String,
    /// Guest kernel boot id.
    pub boot_id: String,
    /// Guest uptime in milliseconds.
    pub uptime_ms: u64,
}

/// Post-restore fixups: fresh entropy, clock, identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreSync {
    /// Host randomness to add to and credit in the guest pool (≥ 64 bytes).
    pub entropy: Vec<u8>,
    /// Host wall clock, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// New hostname, if the identity changed.
    #[serde(default)]
    pub hostname: Option<String>,
    /// New machine-id (32 lowercase hex digits), if the identity changed.
    #[serde(default)]
    pub machine_id: Option<String>,
}

/// Minimum entropy bytes a [`RestoreSync`] must carry.
pub const MIN_RESTORE_ENTROPY: usize = 64;

/// File type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, fifo, socket).
    Other,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// File name (lossy UTF-8).
    pub name: String,
    /// Type (symlinks not followed).
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Owner, link target and `user.` attributes (agents since envd 0.6
    /// emulation; absent from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ext: Option<EntryExt>,
}

/// What newer agents add to a [`DirEntry`] / [`FileStat`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryExt {
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Owner's login name (from the guest's `/etc/passwd`), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Group name (from the guest's `/etc/group`), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// For a symlink: the path it resolves to (absolute, all links
    /// followed; the link's own path when it cannot be resolved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// For a symlink: the type of what it resolves to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kind: Option<FileKind>,
    /// For a symlink: the permission bits of what it resolves to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_mode: Option<u32>,
    /// The entry's `user.` extended attributes with UTF-8 names and values
    /// (at most [`MAX_XATTR_BYTES`] of names and values together).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

/// Most bytes of `user.` attribute names and values an agent reports per
/// entry (and accepts in one [`Request::SetXattrs`]).
pub const MAX_XATTR_BYTES: usize = 8192;

/// Metadata of one path (lstat).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Type (symlinks not followed).
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Owner names, link target and `user.` attributes (newer agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ext: Option<EntryExt>,
}

/// Category of an error reported by the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteErrorKind {
    /// Path, user or program not found.
    NotFound,
    /// EACCES / EPERM.
    PermissionDenied,
    /// ENOSPC / EDQUOT.
    NoSpace,
    /// The command could not be started.
    SpawnFailed,
    /// Bad request (relative path, NUL byte, bad value).
    InvalidArgument,
    /// Target exists.
    AlreadyExists,
    /// A directory where a file was expected.
    IsADirectory,
    /// A non-directory where a directory was expected.
    NotADirectory,
    /// Malformed frame or message; the agent resynchronises.
    Protocol,
    /// Anything else.
    #[serde(other)]
    Other,
}

impl std::fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Self::NotFound => "not found",
            Self::PermissionDenied => "permission denied",
            Self::NoSpace => "no space left",
            Self::SpawnFailed => "spawn failed",
            Self::InvalidArgument => "invalid argument",
            Self::AlreadyExists => "already exists",
            Self::IsADirectory => "is a directory",
            Self::NotADirectory => "not a directory",
            Self::Protocol => "protocol error",
            Self::Other => "error",
        };
        f.write_str(s)
    }
}

impl RemoteErrorKind {
    /// Maps an I/O error to a category.
    pub fn from_io(e: &std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        match e.raw_os_error() {
            Some(28) | Some(122) => return Self::NoSpace, // ENOSPC, EDQUOT
            Some(21) => return Self::IsADirectory,        // EISDIR
            Some(20) => return Self::NotADirectory,       // ENOTDIR
            _ => {}
        }
        match e.kind() {
            K::NotFound => Self::NotFound,
            K::PermissionDenied => Self::PermissionDenied,
            K::AlreadyExists => Self::AlreadyExists,
            K::InvalidInput | K::InvalidData => Self::InvalidArgument,
            _ => Self::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_shape() {
        let r = Request::Exec {
            command: Command::Argv(vec!["echo".into(), "hi".into()]),
            env: BTreeMap::new(),
            cwd: None,
            user: None,
            stdin: false,
            timeout_ms: Some(5),
            pty: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.contains(r#""op":"exec""#), "{s}");
        assert!(s.contains(r#""argv":["echo","hi"]"#), "{s}");
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        let s = serde_json::to_string(&Request::Ping {}).unwrap();
        assert_eq!(s, r#"{"op":"ping"}"#);
    }

    #[test]
    fn pty_is_absent_unless_asked_for() {
        let mut r = Request::Exec {
            command: Command::Shell("tty".into()),
            env: BTreeMap::new(),
            cwd: None,
            user: None,
            stdin: true,
            timeout_ms: None,
            pty: None,
        };
        // What an agent without PTYs has always accepted.
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"op":"exec","command":{"shell":"tty"},"env":{},"cwd":null,"user":null,"stdin":true,"timeout_ms":null}"#
        );
        if let Request::Exec { pty, .. } = &mut r {
            *pty = Some(PtySize { cols: 80, rows: 24 });
        }
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.contains(r#""pty":{"cols":80,"rows":24}"#), "{s}");
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        let s = serde_json::to_string(&Request::Resize {
            cols: 100,
            rows: 30,
        })
        .unwrap();
        assert_eq!(s, r#"{"op":"resize","cols":100,"rows":30}"#);
    }

    #[test]
    fn unknown_fields_and_ops_rejected() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"ping","x":1}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
        assert!(serde_json::from_str::<Request>(
            r#"{"op":"restore_sync","entropy":[],"unix_time_ns":1,"bogus":true}"#
        )
        .is_err());
    }

    #[test]
    fn tunnel_messages_json_shape() {
        let s = serde_json::to_string(&Request::EgressEnable {}).unwrap();
        assert_eq!(s, r#"{"op":"egress_enable"}"#);
        let r: Request = serde_json::from_str(r#"{"op":"tunnel_close"}"#).unwrap();
        assert_eq!(r, Request::TunnelClose { error: None });
        let r: Response = serde_json::from_str(r#"{"op":"tunnel_open","peer":"x"}"#).unwrap();
        assert_eq!(r, Response::TunnelOpen { peer: "x".into() });
        let s = serde_json::to_string(&Response::TunnelAck { bytes: 7 }).unwrap();
        assert_eq!(s, r#"{"op":"tunnel_ack","bytes":7}"#);
        let s = serde_json::to_string(&Response::TunnelEof {}).unwrap();
        assert_eq!(
            serde_json::from_str::<Response>(&s).unwrap(),
            Response::TunnelEof {}
        );
    }

    #[test]
    fn port_connect_json_shape() {
        let s = serde_json::to_string(&Request::PortConnect { port: 8000 }).unwrap();
        assert_eq!(s, r#"{"op":"port_connect","port":8000}"#);
        let r: Response = serde_json::from_str(r#"{"op":"port_connected"}"#).unwrap();
        assert_eq!(r, Response::PortConnected {});
        assert!(serde_json::from_str::<Request>(r#"{"op":"port_connect","port":70000}"#).is_err());
    }

    #[test]
    fn output_flow_control_json_shape() {
        let s = serde_json::to_string(&Request::OutputWindow { bytes: 9 }).unwrap();
        assert_eq!(s, r#"{"op":"output_window","bytes":9}"#);
        let s = serde_json::to_string(&Request::OutputAck { bytes: 3 }).unwrap();
        assert_eq!(s, r#"{"op":"output_ack","bytes":3}"#);
        let r: Request = serde_json::from_str(r#"{"op":"output_discard"}"#).unwrap();
        assert_eq!(r, Request::OutputDiscard {});
        let s = serde_json::to_string(&Request::WriteAbort {}).unwrap();
        assert_eq!(s, r#"{"op":"write_abort"}"#);
    }

    #[test]
    fn watch_messages_json_shape() {
        let s = serde_json::to_string(&Request::Watch {
            path: "/d".into(),
            recursive: true,
        })
        .unwrap();
        assert_eq!(s, r#"{"op":"watch","path":"/d","recursive":true}"#);
        let r: Request = serde_json::from_str(r#"{"op":"watch_poll"}"#).unwrap();
        assert_eq!(r, Request::WatchPoll { wait_ms: 0 });
        let s = serde_json::to_string(&Request::WatchStop {}).unwrap();
        assert_eq!(s, r#"{"op":"watch_stop"}"#);
        let r: Response = serde_json::from_str(
            r#"{"op":"watch_events","events":[{"name":"a","kind":"create","dir":true},{"name":"b","kind":"brand_new"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            Response::WatchEvents {
                events: vec![
                    WatchEvent {
                        name: "a".into(),
                        kind: WatchKind::Create,
                        dir: true
                    },
                    WatchEvent {
                        name: "b".into(),
                        kind: WatchKind::Other,
                        dir: false
                    },
                ],
                more: false,
            }
        );
    }

    #[test]
    fn unknown_error_kind_is_other() {
        let r: Response =
            serde_json::from_str(r#"{"op":"error","kind":"brand_new","message":"m"}"#).unwrap();
        assert_eq!(
            r,
            Response::Error {
                kind: RemoteErrorKind::Other,
                message: "m".into()
            }
        );
    }
}
