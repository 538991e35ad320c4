//! `btrfs send` / `btrfs receive` between pools, as streams.
//!
//! What a move of a sandbox between two strata deployments stands on
//! (`docs/move.md`): the sender streams a read-only snapshot subvolume,
//! incrementally against a parent both sides hold (`btrfs send -p`), and the
//! receiver applies it in its pool's import directory (`<pool>/import/`).
//!
//! Contract:
//! - [`Pool::send`] runs `btrfs send [-p parent] <snapshot>` and hands back
//!   its standard output as a [`SendStream`] (`Read`), counting the bytes;
//!   [`SendStream::finish`] waits for the program and reports its failure.
//!   Dropping an unfinished stream kills the program. Nothing is written to
//!   a temporary file.
//! - [`Pool::receive`] treats the stream as hostile input. Before and while
//!   it feeds `btrfs receive -e -C <import dir>`, it parses every command of
//!   the stream (format versions 1 and 2) and refuses, without anything left
//!   behind: a stream longer than its byte bound, a bad header or a
//!   truncated command, a first command that is not the creation of the one
//!   subvolume expected (by name, and for an incremental stream by the
//!   identity of the parent agreed on), a second subvolume, any clone from a
//!   subvolume other than the parent and itself, symlinks and device nodes
//!   (a snapshot holds plain files), absolute paths and `..` components.
//!   `btrfs receive` runs chrooted into the import directory (`-C`) as a
//!   second wall. A received subvolume that is not whole (program failed,
//!   stream cut, bound hit) is deleted before the error returns; a complete
//!   one is read-only and carries the sender's identity as its received
//!   UUID, which is what the next incremental stream names as its parent.
//! - A subvolume's identity ([`SubvolInfo::identity`]) is what `btrfs send`
//!   writes into a stream: its received UUID if it has one, else its UUID.
//! - [`Pool::anchor_received`] makes one of the pool's own read-only
//!   subvolumes a parent for streams coming back (a sandbox returning to
//!   the pool that made the snapshot): `btrfs receive` is chrooted into the
//!   import directory and finds a parent there only, by received UUID, so
//!   the anchor is a snapshot of it in the import directory given its
//!   identity as received UUID (`BTRFS_IOC_SET_RECEIVED_SUBVOL` on the
//!   writable snapshot, then read-only: what `btrfs receive` does).

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;

use crate::error::StorageError;
use crate::{ioctl, subvol, Pool};

/// Name of the pool directory received subvolumes land in.
pub const IMPORT_DIR: &str = "import";

/// Largest stream command accepted (btrfs sends at most 64 KiB in format 1
/// and 16 KiB + 128 KiB of compressed data in format 2).
pub const MAX_COMMAND_BYTES: u32 = 1 << 20;

/// Most standard-error bytes kept from `btrfs send` / `btrfs receive`.
const MAX_STDERR_BYTES: usize = 16 << 10;

const STREAM_MAGIC: &[u8; 13] = b"btrfs-stream\0";

// Commands of the send stream format (`fs/btrfs/send.h`).
const CMD_SUBVOL: u16 = 1;
const CMD_SNAPSHOT: u16 = 2;
const CMD_MKFILE: u16 = 3;
const CMD_MKDIR: u16 = 4;
const CMD_MKNOD: u16 = 5;
const CMD_MKFIFO: u16 = 6;
const CMD_MKSOCK: u16 = 7;
const CMD_SYMLINK: u16 = 8;
const CMD_RENAME: u16 = 9;
const CMD_LINK: u16 = 10;
const CMD_UNLINK: u16 = 11;
const CMD_RMDIR: u16 = 12;
const CMD_SET_XATTR: u16 = 13;
const CMD_REMOVE_XATTR: u16 = 14;
const CMD_WRITE: u16 = 15;
const CMD_CLONE: u16 = 16;
const CMD_TRUNCATE: u16 = 17;
const CMD_CHMOD: u16 = 18;
const CMD_CHOWN: u16 = 19;
const CMD_UTIMES: u16 = 20;
const CMD_END: u16 = 21;
const CMD_UPDATE_EXTENT: u16 = 22;
const CMD_FALLOCATE: u16 = 23;
const CMD_FILEATTR: u16 = 24;
const CMD_ENCODED_WRITE: u16 = 25;

// Attributes.
const A_UUID: u16 = 1;
const A_PATH: u16 = 15;
const A_PATH_TO: u16 = 16;
const A_PATH_LINK: u16 = 17;
const A_DATA: u16 = 19;
const A_CLONE_UUID: u16 = 20;
const A_CLONE_PATH: u16 = 22;

/// `BTRFS_IOC_GET_SUBVOL_INFO`: `_IOR(0x94, 60, struct btrfs_ioctl_get_subvol_info_args)`.
const BTRFS_IOC_GET_SUBVOL_INFO: u32 = 0x81F8_943C;

/// A btrfs subvolume UUID.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Uuid(pub [u8; 16]);

impl Uuid {
    /// True for the all-zero UUID (btrfs's "none").
    pub fn is_nil(&self) -> bool {
        self.0 == [0; 16]
    }

    /// Parses the hyphenated hex form `8-4-4-4-12` (or 32 hex digits).
    pub fn parse(s: &str) -> Option<Uuid> {
        let hex: Vec<u8> = s.bytes().filter(|b| *b != b'-').collect();
        if hex.len() != 32 || s.len() > 36 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16);
            out[i] = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
        }
        Some(Uuid(out))
    }

    fn non_nil(self) -> Option<Uuid> {
        (!self.is_nil()).then_some(self)
    }
}

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What btrfs knows about one subvolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubvolInfo {
    /// Its own UUID.
    pub uuid: Uuid,
    /// The UUID of the subvolume it was snapshotted from, if any.
    pub parent_uuid: Option<Uuid>,
    /// The identity of the sent subvolume it was received from, if any.
    pub received_uuid: Option<Uuid>,
    /// True if read-only.
    pub readonly: bool,
    /// Its generation (transaction id of its last change).
    pub generation: u64,
    /// The transaction it was created in (a snapshot: the one whose commit
    /// made it).
    pub otransid: u64,
}

impl SubvolInfo {
    /// What `btrfs send` writes as this subvolume's UUID in a stream (and
    /// what a receiver records as its received UUID): the received UUID if
    /// it has one, else its own.
    pub fn identity(&self) -> Uuid {
        self.received_uuid.unwrap_or(self.uuid)
    }
}

#[repr(C)]
struct Timespec {
    sec: u64,
    nsec: u32,
}

/// `struct btrfs_ioctl_get_subvol_info_args` (504 bytes).
#[repr(C)]
struct GetSubvolInfoArgs {
    treeid: u64,
    name: [u8; 256],
    parent_id: u64,
    dirid: u64,
    generation: u64,
    flags: u64,
    uuid: [u8; 16],
    parent_uuid: [u8; 16],
    received_uuid: [u8; 16],
    ctransid: u64,
    otransid: u64,
    stransid: u64,
    rtransid: u64,
    ctime: Timespec,
    otime: Timespec,
    stime: Timespec,
    rtime: Timespec,
    reserved: [u64; 8],
}

/// `BTRFS_IOC_SET_RECEIVED_SUBVOL`:
/// `_IOWR(0x94, 37, struct btrfs_ioctl_received_subvol_args)`.
const BTRFS_IOC_SET_RECEIVED_SUBVOL: u32 = 0xC0C8_9425;

/// `struct btrfs_ioctl_received_subvol_args` (200 bytes).
#[repr(C)]
struct ReceivedSubvolArgs {
    uuid: [u8; 16],
    stransid: u64,
    rtransid: u64,
    stime: Timespec,
    rtime: Timespec,
    flags: u64,
    reserved: [u64; 16],
}

/// Gives the writable subvolume at `path` the received UUID `uuid`
/// (`BTRFS_IOC_SET_RECEIVED_SUBVOL`, what `btrfs receive` does to the
/// subvolume it made before it makes it read-only). The kernel refuses a
/// read-only subvolume (`EROFS`).
fn set_received_uuid(path: &Path, uuid: Uuid, stransid: u64) -> Result<(), StorageError> {
    let dir = subvol::open_dir(path)?;
    let ts = || Timespec { sec: 0, nsec: 0 };
    let mut args = Box::new(ReceivedSubvolArgs {
        uuid: uuid.0,
        stransid,
        rtransid: 0,
        stime: ts(),
        rtime: ts(),
        flags: 0,
        reserved: [0; 16],
    });
    // SAFETY: BTRFS_IOC_SET_RECEIVED_SUBVOL takes a pointer to a
    // `btrfs_ioctl_received_subvol_args`, which `ReceivedSubvolArgs`
    // mirrors field by field (size checked by a unit test, the request
    // number with it); `dir` is an open directory of the subvolume's root.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), BTRFS_IOC_SET_RECEIVED_SUBVOL, args.as_mut()) }
        .map_err(|e| StorageError::io("set the received UUID of", path, e))?;
    Ok(())
}

/// UUIDs and flags of the subvolume at `path` (`BTRFS_IOC_GET_SUBVOL_INFO`).
pub fn subvol_info(path: &Path) -> Result<SubvolInfo, StorageError> {
    if !subvol::is_subvolume(path)? {
        return Err(StorageError::NotASubvolume {
            path: path.to_path_buf(),
        });
    }
    let dir = subvol::open_dir(path)?;
    let ts = || Timespec { sec: 0, nsec: 0 };
    let mut args = Box::new(GetSubvolInfoArgs {
        treeid: 0,
        name: [0; 256],
        parent_id: 0,
        dirid: 0,
        generation: 0,
        flags: 0,
        uuid: [0; 16],
        parent_uuid: [0; 16],
        received_uuid: [0; 16],
        ctransid: 0,
        otransid: 0,
        stransid: 0,
        rtransid: 0,
        ctime: ts(),
        otime: ts(),
        stime: ts(),
        rtime: ts(),
        reserved: [0; 8],
    });
    // SAFETY: BTRFS_IOC_GET_SUBVOL_INFO takes a pointer to a
    // `btrfs_ioctl_get_subvol_info_args`, which `GetSubvolInfoArgs` mirrors
    // field by field (size checked by a unit test); `dir` is an open
    // directory of the subvolume.
    unsafe { ioctl::ioctl_ptr(dir.as_fd(), BTRFS_IOC_GET_SUBVOL_INFO, args.as_mut()) }
        .map_err(|e| StorageError::io("get subvolume info", path, e))?;
    Ok(SubvolInfo {
        uuid: Uuid(args.uuid),
        parent_uuid: Uuid(args.parent_uuid).non_nil(),
        received_uuid: Uuid(args.received_uuid).non_nil(),
        // `BTRFS_ROOT_SUBVOL_RDONLY` of the root item (not the ioctl flag).
        readonly: args.flags & 1 != 0,
        generation: args.generation,
        otransid: args.otransid,
    })
}

/// Why a send or a receive failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// A pool operation failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The stream is not a well-formed btrfs send stream of the expected
    /// kind (or uses something a snapshot never holds).
    #[error("refused send stream: {0}")]
    BadStream(String),
    /// The stream creates a subvolume with another name than expected.
    #[error("the stream creates subvolume {found:?}, expected {expected:?}")]
    UnexpectedName {
        /// The name agreed on.
        expected: String,
        /// The name the stream carries.
        found: String,
    },
    /// The stream's parent is not the one agreed on (or it is incremental
    /// where a full stream was expected, or the reverse).
    #[error("the stream's parent is {found}, expected {expected}")]
    UnexpectedParent {
        /// The parent agreed on (`none` for a full stream).
        expected: String,
        /// The parent the stream names.
        found: String,
    },
    /// The stream is longer than the bound of this receive.
    #[error("the stream exceeds its bound of {limit} bytes")]
    TooLarge {
        /// The bound.
        limit: u64,
    },
    /// The stream ended before its end command.
    #[error("the stream ended after {bytes} bytes, before its end")]
    Truncated {
        /// Bytes read.
        bytes: u64,
    },
    /// Reading the incoming stream failed (e.g. the connection dropped).
    #[error("reading the stream failed")]
    Read(#[source] io::Error),
    /// A subvolume of that name was already received.
    #[error("{0} was already received")]
    AlreadyReceived(String),
    /// `btrfs send` or `btrfs receive` failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The program and its arguments.
        command: String,
        /// Its exit status.
        status: String,
        /// Its standard error, trimmed and bounded.
        stderr: String,
    },
}

/// What a running `btrfs send` produces: its standard output.
///
/// Read it to the end, then call [`SendStream::finish`]. Dropped early, the
/// program is killed.
pub struct SendStream {
    child: Option<Child>,
    stdout: Option<ChildStdout>,
    stderr: Option<JoinHandle<String>>,
    command: String,
    bytes: u64,
}

impl fmt::Debug for SendStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendStream")
            .field("command", &self.command)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl SendStream {
    /// Bytes read from the stream so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Waits for `btrfs send` to end; the number of bytes it produced.
    pub fn finish(mut self) -> Result<u64, TransferError> {
        // Drain what was not read, so the program can end.
        if let Some(mut out) = self.stdout.take() {
            let n = io::copy(&mut out, &mut io::sink()).map_err(TransferError::Read)?;
            self.bytes += n;
        }
        let Some(mut child) = self.child.take() else {
            return Ok(self.bytes);
        };
        let status = child
            .wait()
            .map_err(|e| StorageError::io("wait for", "btrfs send", e))?;
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        if !status.success() {
            return Err(TransferError::Command {
                command: self.command.clone(),
                status: status.to_string(),
                stderr,
            });
        }
        Ok(self.bytes)
    }
}

impl Read for SendStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(out) = self.stdout.as_mut() else {
            return Ok(0);
        };
        let n = out.read(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
}

impl Drop for SendStream {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What [`Pool::receive`] expects of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveSpec {
    /// The name of the subvolume the stream must create (one path
    /// component; it lands at `<pool>/import/<name>`).
    pub name: String,
    /// The identity of the parent the stream must be relative to, or `None`
    /// for a full stream. The parent must have been received before.
    pub parent: Option<Uuid>,
    /// Most bytes of stream accepted.
    pub max_bytes: u64,
}

/// A complete received subvolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Where it is (`<pool>/import/<name>`).
    pub path: PathBuf,
    /// Its btrfs facts (read-only, received UUID = the sender's identity).
    pub info: SubvolInfo,
    /// Bytes of stream applied.
    pub bytes: u64,
}

/// What the stream checker learnt from a whole, valid stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSummary {
    /// The name of the subvolume it creates.
    pub name: String,
    /// The sender's identity of it.
    pub uuid: Uuid,
    /// The parent it is relative to (incremental streams).
    pub parent: Option<Uuid>,
    /// Stream bytes.
    pub bytes: u64,
}

impl Pool {
    /// `<pool>/import`: where received subvolumes land (created on demand).
    pub fn import_dir(&self) -> PathBuf {
        self.root().join(IMPORT_DIR)
    }

    /// Starts `btrfs send` of the read-only snapshot `snapshot`, incremental
    /// against the read-only `parent` if given.
    pub fn send(
        &self,
        snapshot: &Path,
        parent: Option<&Path>,
    ) -> Result<SendStream, TransferError> {
        let snap = self.inside(snapshot)?;
        let parent = parent.map(|p| self.inside(p)).transpose()?;
        for p in std::iter::once(&snap).chain(parent.as_ref()) {
            if !subvol_info(p)?.readonly {
                return Err(StorageError::InvalidArgument {
                    what: p.display().to_string(),
                    reason: "btrfs send needs a read-only subvolume".into(),
                }
                .into());
            }
        }
        let btrfs = crate::pool::find_tool("btrfs", "btrfs-progs")?;
        let mut cmd = Command::new(btrfs);
        cmd.arg("send").arg("-q");
        if let Some(p) = &parent {
            cmd.arg("-p").arg(p);
        }
        cmd.arg(&snap)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let command = format!("{cmd:?}").replace('"', "");
        let mut child = cmd
            .spawn()
            .map_err(|e| StorageError::io("start", "btrfs send", e))?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take().map(spawn_stderr_reader);
        Ok(SendStream {
            child: Some(child),
            stdout,
            stderr,
            command,
            bytes: 0,
        })
    }

    /// Lists the complete received subvolumes of the import directory
    /// (read-only with a received UUID), by name. Anything else there (a
    /// partial receive of a crashed daemon) is left out.
    pub fn list_received(&self) -> Result<Vec<(String, SubvolInfo)>, StorageError> {
        let dir = self.import_dir();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StorageError::io("list", &dir, e)),
        };
        let mut out = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| StorageError::io("list", &dir, e))?;
            let Some(name) = ent.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            match subvol_info(&ent.path()) {
                Ok(i) if i.readonly && i.received_uuid.is_some() => out.push((name, i)),
                _ => {}
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Makes `import/<name>` a parent that incremental streams naming the
    /// identity of this pool's own read-only subvolume `source` can be
    /// received against: `btrfs receive` is chrooted into the import
    /// directory, so it finds a parent only there, by received UUID. A
    /// writable snapshot of `source` (same data, no copy), given
    /// `source`'s identity as its received UUID, then made read-only —
    /// what `btrfs receive` itself leaves behind for a subvolume it
    /// received. Used when a sandbox comes back to a pool that made the
    /// snapshot the sender's copy was received from (a return move).
    ///
    /// Idempotent: an anchor (or a received subvolume) of that name with
    /// that identity is answered as it is; one with another identity is
    /// [`TransferError::AlreadyReceived`]. On error nothing is left.
    pub fn anchor_received(&self, source: &Path, name: &str) -> Result<SubvolInfo, TransferError> {
        check_name(name).map_err(|reason| StorageError::InvalidArgument {
            what: name.into(),
            reason,
        })?;
        let source = self.inside(source)?;
        let src = subvol_info(&source)?;
        if !src.readonly {
            return Err(StorageError::InvalidArgument {
                what: source.display().to_string(),
                reason: "a parent anchor is made of a read-only subvolume".into(),
            }
            .into());
        }
        let identity = src.identity();
        let target = self.import_dir_made()?.join(name);
        if target.exists() {
            match subvol_info(&target) {
                Ok(i) if i.readonly && i.received_uuid == Some(identity) => return Ok(i),
                Ok(i) if i.readonly && i.received_uuid.is_some() => {
                    return Err(TransferError::AlreadyReceived(name.to_owned()))
                }
                // A partial anchor or receive of a crashed daemon.
                _ => remove_partial(&target)?,
            }
        }
        let made = (|| {
            subvol::snapshot(&source, &target, false)?;
            set_received_uuid(&target, identity, src.generation)?;
            subvol::set_readonly(&target, true)?;
            subvol_info(&target)
        })();
        match made {
            Ok(i) if i.readonly && i.received_uuid == Some(identity) => Ok(i),
            other => {
                if target.exists() {
                    if let Err(r) = remove_partial(&target) {
                        tracing::warn!(path = %target.display(), error = %r, "cannot remove a partial parent anchor");
                    }
                }
                match other {
                    Err(e) => Err(e.into()),
                    Ok(_) => Err(TransferError::BadStream(
                        "the parent anchor did not keep its received UUID".into(),
                    )),
                }
            }
        }
    }

    /// The import directory, made if missing, resolved inside the pool.
    fn import_dir_made(&self) -> Result<std::path::PathBuf, TransferError> {
        let dir = self.import_dir();
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StorageError::io("create", &dir, e).into()),
        }
        Ok(self.inside(&dir)?)
    }

    /// Deletes the received subvolume `name` of the import directory.
    /// Idempotent.
    pub fn delete_received(&self, name: &str) -> Result<(), StorageError> {
        check_name(name).map_err(|reason| StorageError::InvalidArgument {
            what: name.into(),
            reason,
        })?;
        let p = self.import_dir().join(name);
        if !p.exists() {
            return Ok(());
        }
        remove_partial(&p)
    }

    /// Applies the hostile stream `input` in the import directory (see the
    /// module docs): the subvolume `spec.name`, complete and read-only, or
    /// an error and nothing left behind.
    pub fn receive(&self, spec: &ReceiveSpec, input: impl Read) -> Result<Received, TransferError> {
        check_name(&spec.name).map_err(|reason| StorageError::InvalidArgument {
            what: spec.name.clone(),
            reason,
        })?;
        let dir = self.import_dir_made()?;
        let target = dir.join(&spec.name);
        if target.exists() {
            match subvol_info(&target) {
                Ok(i) if i.readonly && i.received_uuid.is_some() => {
                    return Err(TransferError::AlreadyReceived(spec.name.clone()))
                }
                // A partial subvolume of an interrupted receive.
                _ => remove_partial(&target)?,
            }
        }
        let btrfs = crate::pool::find_tool("btrfs", "btrfs-progs")?;
        let mut cmd = Command::new(btrfs);
        cmd.args(["receive", "-q", "-e", "-C"])
            .arg(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let command = format!("{cmd:?}").replace('"', "");
        let mut child = cmd
            .spawn()
            .map_err(|e| StorageError::io("start", "btrfs receive", e))?;
        let stderr = child.stderr.take().map(spawn_stderr_reader);
        let fed = match child.stdin.take() {
            Some(stdin) => check_stream(input, stdin, spec),
            None => Err(TransferError::BadStream("no stdin".into())),
        };
        let fail = |child: &mut Child, e: TransferError| -> TransferError {
            let _ = child.kill();
            let _ = child.wait();
            if target.exists() {
                if let Err(r) = remove_partial(&target) {
                    tracing::warn!(path = %target.display(), error = %r, "cannot remove a partial receive");
                }
            }
            e
        };
        let (summary, status) = match fed {
            Ok(s) => (s, child.wait()),
            Err(e) => {
                let e = match e {
                    // btrfs receive quit first: its message says why.
                    TransferError::Command { .. } => {
                        let _ = child.kill();
                        let _ = child.wait();
                        TransferError::Command {
                            command: command.clone(),
                            status: "ended early".into(),
                            stderr: stderr.and_then(|h| h.join().ok()).unwrap_or_default(),
                        }
                    }
                    e => e,
                };
                return Err(fail(&mut child, e));
            }
        };
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                let e = StorageError::io("wait for", "btrfs receive", e).into();
                return Err(fail(&mut child, e));
            }
        };
        let stderr = stderr.and_then(|h| h.join().ok()).unwrap_or_default();
        if !status.success() {
            let e = TransferError::Command {
                command,
                status: status.to_string(),
                stderr,
            };
            return Err(fail(&mut child, e));
        }
        let info = match subvol_info(&target) {
            Ok(i) if i.readonly && i.received_uuid == Some(summary.uuid) => i,
            Ok(_) => {
                let e = TransferError::BadStream(
                    "the received subvolume is not read-only with the stream's UUID".into(),
                );
                return Err(fail(&mut child, e));
            }
            Err(e) => return Err(fail(&mut child, e.into())),
        };
        Ok(Received {
            path: target,
            info,
            bytes: summary.bytes,
        })
    }
}

/// A subvolume name the import directory accepts: one path component of
/// `[A-Za-z0-9._@-]`, not `.`/`..`, at most 200 bytes.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 200 {
        return Err("must be 1 to 200 bytes".into());
    }
    if name == "." || name == ".." || name.starts_with('.') {
        return Err("must not start with a dot".into());
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-'))
    {
        return Err("only letters, digits, '.', '_', '@' and '-'".into());
    }
    Ok(())
}

/// Deletes a (possibly read-only) subvolume left by a failed receive.
fn remove_partial(path: &Path) -> Result<(), StorageError> {
    if subvol::is_subvolume(path)? {
        if subvol::is_readonly(path)? {
            subvol::set_readonly(path, false)?;
        }
        subvol::delete_subvolume(path)
    } else {
        std::fs::remove_dir_all(path).map_err(|e| StorageError::io("remove", path, e))
    }
}

fn spawn_stderr_reader(mut err: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let _ = (&mut err)
            .take(MAX_STDERR_BYTES as u64)
            .read_to_end(&mut kept);
        let _ = io::copy(&mut err, &mut io::sink());
        String::from_utf8_lossy(&kept).trim().to_string()
    })
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on EOF before the first byte.
fn read_full(r: &mut impl Read, buf: &mut [u8], read: u64) -> Result<bool, TransferError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(TransferError::Truncated {
                    bytes: read + got as u64,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransferError::Read(e)),
        }
    }
    Ok(true)
}

/// One attribute of a command: (type, value).
fn attrs(payload: &[u8], version: u32) -> Result<Vec<(u16, &[u8])>, TransferError> {
    let mut out = Vec::new();
    let mut rest = payload;
    while !rest.is_empty() {
        if rest.len() < 2 {
            return Err(TransferError::BadStream("torn attribute".into()));
        }
        let ty = u16::from_le_bytes([rest[0], rest[1]]);
        // Format 2 writes file data last, without a length.
        if version >= 2 && ty == A_DATA {
            out.push((ty, &rest[2..]));
            break;
        }
        if rest.len() < 4 {
            return Err(TransferError::BadStream("torn attribute".into()));
        }
        let len = u16::from_le_bytes([rest[2], rest[3]]) as usize;
        let Some(val) = rest.get(4..4 + len) else {
            return Err(TransferError::BadStream(
                "attribute longer than its command".into(),
            ));
        };
        out.push((ty, val));
        rest = &rest[4 + len..];
    }
    Ok(out)
}

fn uuid_of(val: &[u8]) -> Result<Uuid, TransferError> {
    let b: [u8; 16] = val
        .try_into()
        .map_err(|_| TransferError::BadStream("a UUID attribute is not 16 bytes".into()))?;
    Ok(Uuid(b))
}

fn check_path(val: &[u8]) -> Result<(), TransferError> {
    let bad = val.first() == Some(&b'/')
        || val.contains(&0)
        || val.split(|b| *b == b'/').any(|c| c == b"..");
    if bad {
        return Err(TransferError::BadStream(format!(
            "path {:?} leaves the subvolume",
            String::from_utf8_lossy(val)
        )));
    }
    Ok(())
}

/// Checks the stream `input` command by command against `spec` while
/// copying it to `out`. `Err(TransferError::Command)` when `out` refused a
/// write (the receiving program ended).
pub fn check_stream(
    mut input: impl Read,
    mut out: impl Write,
    spec: &ReceiveSpec,
) -> Result<StreamSummary, TransferError> {
    let mut bytes: u64 = 0;
    let put = |out: &mut dyn Write, b: &[u8], bytes: &mut u64| -> Result<(), TransferError> {
        *bytes += b.len() as u64;
        if *bytes > spec.max_bytes {
            return Err(TransferError::TooLarge {
                limit: spec.max_bytes,
            });
        }
        out.write_all(b).map_err(|e| TransferError::Command {
            command: "btrfs receive".into(),
            status: "stdin closed".into(),
            stderr: e.to_string(),
        })
    };
    let mut header = [0u8; 17];
    if !read_full(&mut input, &mut header, 0)? {
        return Err(TransferError::Truncated { bytes: 0 });
    }
    if &header[..13] != STREAM_MAGIC {
        return Err(TransferError::BadStream("not a btrfs send stream".into()));
    }
    let version = u32::from_le_bytes([header[13], header[14], header[15], header[16]]);
    if !(1..=2).contains(&version) {
        return Err(TransferError::BadStream(format!(
            "stream format version {version} is not supported"
        )));
    }
    put(&mut out, &header, &mut bytes)?;
    let mut summary: Option<StreamSummary> = None;
    let mut payload = Vec::new();
    loop {
        let mut ch = [0u8; 10];
        if !read_full(&mut input, &mut ch, bytes)? {
            return Err(TransferError::Truncated { bytes });
        }
        let len = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
        let cmd = u16::from_le_bytes([ch[4], ch[5]]);
        if len > MAX_COMMAND_BYTES {
            return Err(TransferError::BadStream(format!(
                "command of {len} bytes is too long"
            )));
        }
        if bytes + 10 + u64::from(len) > spec.max_bytes {
            return Err(TransferError::TooLarge {
                limit: spec.max_bytes,
            });
        }
        payload.resize(len as usize, 0);
        if len > 0 && !read_full(&mut input, &mut payload, bytes + 10)? {
            return Err(TransferError::Truncated { bytes: bytes + 10 });
        }
        let at = attrs(&payload, version)?;
        let first = |ty: u16| at.iter().find(|(t, _)| *t == ty).map(|(_, v)| *v);
        match (cmd, &summary) {
            (CMD_SUBVOL | CMD_SNAPSHOT, None) => {
                let name = first(A_PATH)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                if name != spec.name {
                    return Err(TransferError::UnexpectedName {
                        expected: spec.name.clone(),
                        found: name,
                    });
                }
                let uuid = uuid_of(first(A_UUID).unwrap_or_default())?;
                let parent = if cmd == CMD_SNAPSHOT {
                    Some(uuid_of(first(A_CLONE_UUID).unwrap_or_default())?)
                } else {
                    None
                };
                if parent != spec.parent {
                    let show = |u: Option<Uuid>| u.map_or("none".into(), |u| u.to_string());
                    return Err(TransferError::UnexpectedParent {
                        expected: show(spec.parent),
                        found: show(parent),
                    });
                }
                summary = Some(StreamSummary {
                    name,
                    uuid,
                    parent,
                    bytes: 0,
                });
            }
            (_, None) => {
                return Err(TransferError::BadStream(
                    "the first command does not create a subvolume".into(),
                ))
            }
            (CMD_SUBVOL | CMD_SNAPSHOT, Some(_)) => {
                return Err(TransferError::BadStream(
                    "the stream creates a second subvolume".into(),
                ))
            }
            (CMD_SYMLINK | CMD_MKNOD | CMD_MKFIFO | CMD_MKSOCK, Some(_)) => {
                return Err(TransferError::BadStream(format!(
                    "command {cmd} (symlink or special file) has no place in a snapshot"
                )))
            }
            (CMD_CLONE, Some(s)) => {
                let src = uuid_of(first(A_CLONE_UUID).unwrap_or_default())?;
                if src != s.uuid && Some(src) != s.parent {
                    return Err(TransferError::BadStream(format!(
                        "clone from subvolume {src}, which is neither the parent nor itself"
                    )));
                }
            }
            (
                CMD_MKFILE | CMD_MKDIR | CMD_RENAME | CMD_LINK | CMD_UNLINK | CMD_RMDIR
                | CMD_SET_XATTR | CMD_REMOVE_XATTR | CMD_WRITE | CMD_TRUNCATE | CMD_CHMOD
                | CMD_CHOWN | CMD_UTIMES | CMD_END | CMD_UPDATE_EXTENT | CMD_FALLOCATE
                | CMD_FILEATTR | CMD_ENCODED_WRITE,
                Some(_),
            ) => {}
            (other, Some(_)) => {
                return Err(TransferError::BadStream(format!("unknown command {other}")))
            }
        }
        if summary.is_some() && !matches!(cmd, CMD_SUBVOL | CMD_SNAPSHOT) {
            for (ty, val) in &at {
                if matches!(*ty, A_PATH | A_PATH_TO | A_PATH_LINK | A_CLONE_PATH) {
                    check_path(val)?;
                }
            }
        }
        put(&mut out, &ch, &mut bytes)?;
        put(&mut out, &payload, &mut bytes)?;
        if cmd == CMD_END {
            break;
        }
    }
    // Nothing may follow the end command.
    let mut extra = [0u8; 1];
    if read_full(&mut input, &mut extra, bytes)? {
        return Err(TransferError::BadStream(
            "data after the end of the stream".into(),
        ));
    }
    out.flush().map_err(|e| TransferError::Command {
        command: "btrfs receive".into(),
        status: "stdin closed".into(),
        stderr: e.to_string(),
    })?;
    drop(out);
    let mut s = summary.ok_or_else(|| TransferError::BadStream("empty stream".into()))?;
    s.bytes = bytes;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> ReceiveSpec {
        ReceiveSpec {
            name: name.into(),
            parent: None,
            max_bytes: 1 << 20,
        }
    }

    fn cmd(ty: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut p = Vec::new();
        for (t, v) in attrs {
            p.extend_from_slice(&t.to_le_bytes());
            p.extend_from_slice(&(v.len() as u16).to_le_bytes());
            p.extend_from_slice(v);
        }
        let mut c = (p.len() as u32).to_le_bytes().to_vec();
        c.extend_from_slice(&ty.to_le_bytes());
        c.extend_from_slice(&[0; 4]);
        c.extend_from_slice(&p);
        c
    }

    fn stream(cmds: &[Vec<u8>]) -> Vec<u8> {
        let mut s = STREAM_MAGIC.to_vec();
        s.extend_from_slice(&1u32.to_le_bytes());
        for c in cmds {
            s.extend_from_slice(c);
        }
        s
    }

    #[test]
    fn struct_size_matches_kernel_header() {
        assert_eq!(size_of::<GetSubvolInfoArgs>(), 504);
    }

    #[test]
    fn set_received_subvol_matches_kernel_header() {
        assert_eq!(size_of::<ReceivedSubvolArgs>(), 200);
        assert_eq!(
            BTRFS_IOC_SET_RECEIVED_SUBVOL,
            (3 << 30) | (200 << 16) | (0x94 << 8) | 37
        );
    }

    #[test]
    fn uuid_round_trips() {
        let u = Uuid([0xab; 16]);
        assert_eq!(Uuid::parse(&u.to_string()), Some(u));
        assert_eq!(Uuid::parse("zz"), None);
    }

    #[test]
    fn a_minimal_valid_stream_passes_and_is_copied() {
        let s = stream(&[
            cmd(CMD_SUBVOL, &[(A_PATH, b"snap-1"), (A_UUID, &[7; 16])]),
            cmd(CMD_MKFILE, &[(A_PATH, b"mem")]),
            cmd(CMD_END, &[]),
        ]);
        let mut out = Vec::new();
        let sum = check_stream(&s[..], &mut out, &spec("snap-1")).unwrap();
        assert_eq!(out, s);
        assert_eq!(sum.uuid, Uuid([7; 16]));
        assert_eq!(sum.bytes, s.len() as u64);
    }

    #[test]
    fn hostile_streams_are_refused() {
        let sv = cmd(CMD_SUBVOL, &[(A_PATH, b"snap-1"), (A_UUID, &[7; 16])]);
        let end = cmd(CMD_END, &[]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"garbage garbage garbage".to_vec(), "not a btrfs"),
            (
                stream(&[
                    cmd(CMD_SUBVOL, &[(A_PATH, b"other"), (A_UUID, &[7; 16])]),
                    end.clone(),
                ]),
                "expected",
            ),
            (stream(std::slice::from_ref(&sv)), "ended"),
            (
                stream(&[sv.clone(), cmd(CMD_SYMLINK, &[(A_PATH, b"x")]), end.clone()]),
                "symlink",
            ),
            (
                stream(&[
                    sv.clone(),
                    cmd(CMD_MKFILE, &[(A_PATH, b"../etc")]),
                    end.clone(),
                ]),
                "leaves",
            ),
            (stream(&[sv.clone(), sv.clone(), end.clone()]), "second"),
            (
                stream(&[
                    sv.clone(),
                    cmd(CMD_CLONE, &[(A_PATH, b"mem"), (A_CLONE_UUID, &[9; 16])]),
                    end.clone(),
                ]),
                "neither the parent",
            ),
            (
                stream(&[
                    cmd(
                        CMD_SNAPSHOT,
                        &[
                            (A_PATH, b"snap-1"),
                            (A_UUID, &[7; 16]),
                            (A_CLONE_UUID, &[9; 16]),
                        ],
                    ),
                    end.clone(),
                ]),
                "parent",
            ),
            (
                {
                    let mut s = stream(&[sv.clone(), end.clone()]);
                    s.push(0);
                    s
                },
                "after the end",
            ),
        ];
        for (s, want) in cases {
            let mut out = Vec::new();
            let e = check_stream(&s[..], &mut out, &spec("snap-1")).unwrap_err();
            assert!(e.to_string().contains(want), "{e} (wanted {want})");
        }
        let big = stream(&[
            sv,
            cmd(CMD_WRITE, &[(A_PATH, b"mem"), (A_DATA, &[0; 4000])]),
            end,
        ]);
        let e = check_stream(
            &big[..],
            &mut Vec::new(),
            &ReceiveSpec {
                max_bytes: 1000,
                ..spec("snap-1")
            },
        )
        .unwrap_err();
        assert!(matches!(e, TransferError::TooLarge { limit: 1000 }), "{e}");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("snap-01HX@x.y_z").is_ok());
        for bad in ["", ".", "..", "a/b", ".hidden", "a b"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
