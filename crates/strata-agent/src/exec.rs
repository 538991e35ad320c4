//! Running commands: own process group, optional user, streamed output,
//! timeout that kills the whole group.
//!
//! Output flow control (see `PROTOCOL.md`, *Flow control*): when the session
//! windows output, one task reads both pipes and never has more than the
//! window of stdout and stderr together sent and not acknowledged; with the
//! credit used up it stops reading, so the command blocks on its next write.
//! When the host discards the output, or the session ends, the task keeps
//! reading and drops what it reads, so the command runs on.
//!
//! Pseudo-terminals (`exec` with `pty`): the agent opens a PTY pair, the
//! command gets the slave as stdin, stdout and stderr and as its controlling
//! terminal (`setsid` + `TIOCSCTTY`), the agent keeps the master: what it
//! reads from it goes out as stdout under the same output window, `Stdin`
//! frames are written to it, `resize` sets its window size. The line
//! discipline turns `^C` into `SIGINT` for the foreground process group.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use strata_proto::frame::FrameKind;
use strata_proto::{Command, PtySize, RemoteErrorKind, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::process::Child;
use tokio::sync::{mpsc, watch};

use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::{OutputCredit, Slot};
use crate::user;

/// Output chunk size.
const OUT_CHUNK: usize = 64 * 1024;
/// How long to wait for output pipes after the leader exited (background
/// children may hold them open).
const PIPE_GRACE: Duration = Duration::from_millis(500);
/// Step of the pipe grace clock.
const GRACE_TICK: Duration = Duration::from_millis(50);

/// Hosts commands reach directly even with egress on.
const NO_PROXY: &str = "localhost,127.0.0.1";

/// `TERM` of a command on a PTY unless its request names one.
const DEFAULT_TERM: &str = "xterm-256color";

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What to run (parsed from the request).
pub struct Spec {
    /// Argv or shell.
    pub command: Command,
    /// Extra env.
    pub env: BTreeMap<String, String>,
    /// Working dir.
    pub cwd: Option<String>,
    /// User.
    pub user: Option<String>,
    /// Pipe stdin.
    pub stdin: bool,
    /// Timeout.
    pub timeout: Option<Duration>,
    /// Egress proxy URL for the `*_proxy` variables (egress enabled).
    pub proxy: Option<String>,
    /// Run on a new PTY of this size.
    pub pty: Option<PtySize>,
}

/// A started command: the child and, for a PTY command, the master side of
/// its terminal (the agent's only copy; the child has the slave).
pub struct Spawned {
    /// The process.
    pub child: Child,
    /// PTY master, if it runs on a PTY.
    pub pty: Option<Arc<OwnedFd>>,
}

/// Sets the window size of the PTY whose master is `master`; the kernel
/// sends `SIGWINCH` to its foreground process group.
pub fn resize(master: &OwnedFd, size: PtySize) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the valid pointer; the fd
    // is owned and open.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Opens a PTY pair of window `size`: `(master, slave)`, both close-on-exec,
/// the master non-blocking. `owner`: uid and gid the slave is given (the
/// command's user, as `login` does).
fn open_pty(size: PtySize, owner: Option<(u32, u32)>) -> io::Result<(OwnedFd, OwnedFd)> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let m = unsafe { libc::posix_openpt(flags) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `m` is a fresh fd nobody else owns.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    // SAFETY: plain syscalls on the owned master fd.
    if unsafe { libc::grantpt(m) } < 0 || unsafe { libc::unlockpt(m) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut name = [0u8; 128];
    // SAFETY: ptsname_r writes at most `name.len()` bytes, NUL-terminated.
    let r = unsafe { libc::ptsname_r(m, name.as_mut_ptr().cast(), name.len()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let path = std::str::from_utf8(&name[..end]).map_err(io::Error::other)?;
    use std::os::unix::fs::OpenOptionsExt;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(path)?
        .into();
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&slave, Some(uid), Some(gid))?;
    }
    resize(&master, size)?;
    Ok((master, slave))
}

/// Spawns the process (in its own session / process group; on a PTY, that
/// session's controlling terminal is the PTY).
pub fn spawn(spec: &Spec) -> Result<Spawned, Fail> {
    let (prog, args): (String, Vec<String>) = match &spec.command {
        Command::Argv(v) => {
            let Some((p, rest)) = v.split_first() else {
                return Err(Fail::new(RemoteErrorKind::InvalidArgument, "empty argv"));
            };
            (p.clone(), rest.to_vec())
        }
        Command::Shell(s) => ("/bin/sh".into(), vec!["-c".into(), s.clone()]),
    };
    let nul = |s: &str| s.contains('\0');
    if nul(&prog)
        || args.iter().any(|a| nul(a))
        || spec
            .env
            .iter()
            .any(|(k, v)| nul(k) || nul(v) || k.contains('=') || k.is_empty())
    {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            "NUL byte in argv or env, or invalid variable name",
        ));
    }
    let user = match &spec.user {
        None => None,
        Some(u) => Some(user::lookup(Path::new("/"), u).ok_or_else(|| {
            Fail::new(
                RemoteErrorKind::NotFound,
                format!("user {u:?} not found in /etc/passwd"),
            )
        })?),
    };
    if let Some(cwd) = &spec.cwd {
        let p = crate::files::check_path(cwd)?;
        match std::fs::metadata(&p) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Fail::new(
                    RemoteErrorKind::NotADirectory,
                    format!("cwd {cwd} is not a directory"),
                ))
            }
            Err(e) => return Err(Fail::io(&e, &format!("cwd {cwd}"))),
        }
    }
    let pty = match spec.pty {
        None => None,
        Some(size) => {
            let owner = user.as_ref().map(|u| (u.uid, u.gid));
            Some(open_pty(size, owner).map_err(|e| Fail::io(&e, "cannot open a pty"))?)
        }
    };
    let mut cmd = tokio::process::Command::new(&prog);
    cmd.args(&args)
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("LANG", "C.UTF-8")
        .kill_on_drop(false);
    let ctty = match &pty {
        Some((_, slave)) => {
            let dup = |f: &OwnedFd| {
                f.try_clone()
                    .map(Stdio::from)
                    .map_err(|e| Fail::io(&e, "cannot duplicate the pty"))
            };
            cmd.stdin(dup(slave)?)
                .stdout(dup(slave)?)
                .stderr(dup(slave)?)
                .env("TERM", DEFAULT_TERM);
            true
        }
        None => {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            false
        }
    };
    match &user {
        Some(u) => {
            cmd.env("HOME", &u.home)
                .env("USER", &u.name)
                .env("LOGNAME", &u.name);
        }
        None => {
            cmd.env("HOME", "/root");
        }
    }
    if let Some(url) = &spec.proxy {
        for k in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
            cmd.env(k, url);
        }
        cmd.env("no_proxy", NO_PROXY).env("NO_PROXY", NO_PROXY);
    }
    cmd.envs(&spec.env);
    cmd.current_dir(spec.cwd.as_deref().unwrap_or("/"));
    let ids = user.map(|u| (u.uid, u.gid, u.groups));
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (signal, setsid, ioctl, setgroups,
    // setgid, setuid) on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Default dispositions whatever the agent inherited: a process
            // started as a shell's background job ignores SIGINT and
            // SIGQUIT, and ignored signals survive exec, so ^C on a PTY or
            // a signal sent through the API would do nothing. (std resets
            // the signal mask and SIGPIPE itself.)
            for sig in 1..32 {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    libc::signal(sig, libc::SIG_DFL);
                }
            }
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The PTY slave is fd 0 already (stdio is set up before this
            // runs): make it the new session's controlling terminal.
            if ctty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some((uid, gid, groups)) = &ids {
                if libc::setgroups(groups.len(), groups.as_ptr()) < 0
                    || libc::setgid(*gid) < 0
                    || libc::setuid(*uid) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| {
        let kind = match e.kind() {
            std::io::ErrorKind::NotFound => RemoteErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => RemoteErrorKind::PermissionDenied,
            _ => RemoteErrorKind::SpawnFailed,
        };
        Fail::new(kind, format!("cannot start {prog:?}: {e}"))
    })?;
    // The agent's copies of the slave go with `cmd` and `pty`'s second half:
    // once the command's side closes, reading the master ends.
    drop(cmd);
    Ok(Spawned {
        child,
        pty: pty.map(|(master, _slave)| Arc::new(master)),
    })
}

/// Sends `sig` to the process group `pgid`.
pub fn kill_group(pgid: i32, sig: i32) {
    if pgid <= 1 {
        return;
    }
    // SAFETY: plain syscall; pgid > 1 so we never signal everything.
    unsafe { libc::kill(-pgid, sig) };
}

/// A command's output window: its size and the host's credit.
pub struct Window {
    /// Bytes of stdout and stderr together that may be unacknowledged.
    pub size: u64,
    /// The host's acknowledgements (closed: the session ended).
    pub credit: watch::Receiver<OutputCredit>,
}

/// Reads from `r` if it is still open; never resolves otherwise.
async fn read_open<R: AsyncRead + Unpin>(r: &mut Option<R>, buf: &mut [u8]) -> io::Result<usize> {
    match r {
        Some(r) => r.read(buf).await,
        None => std::future::pending().await,
    }
}

/// Sends a command's stdout and stderr until both reach end of file,
/// within `window` if the session windows output. `waiting` is set while
/// it waits for credit.
async fn pump_output<O, E>(
    mut stdout: Option<O>,
    mut stderr: Option<E>,
    id: u32,
    out: Outbox,
    mut window: Option<Window>,
    waiting: Arc<AtomicBool>,
) where
    O: AsyncRead + Unpin,
    E: AsyncRead + Unpin,
{
    let mut bo = vec![0u8; OUT_CHUNK];
    let mut be = vec![0u8; OUT_CHUNK];
    let mut sent = 0u64;
    // Read and drop: the host discarded the output, or the session ended.
    let mut drop_all = false;
    while stdout.is_some() || stderr.is_some() {
        let mut room = OUT_CHUNK;
        if let (Some(w), false) = (&mut window, drop_all) {
            loop {
                let c = *w.credit.borrow_and_update();
                if c.discard {
                    drop_all = true;
                    break;
                }
                let in_flight = sent.saturating_sub(c.acked);
                if in_flight < w.size {
                    room = (w.size - in_flight).min(OUT_CHUNK as u64) as usize;
                    break;
                }
                waiting.store(true, Ordering::SeqCst);
                let changed = w.credit.changed().await;
                waiting.store(false, Ordering::SeqCst);
                if changed.is_err() {
                    drop_all = true;
                    break;
                }
            }
        }
        let (kind, r) = tokio::select! {
            r = read_open(&mut stdout, &mut bo[..room]) => (FrameKind::Stdout, r),
            r = read_open(&mut stderr, &mut be[..room]) => (FrameKind::Stderr, r),
        };
        let n = match r {
            Ok(n) if n > 0 => n,
            _ => {
                if kind == FrameKind::Stdout {
                    stdout = None;
                } else {
                    stderr = None;
                }
                continue;
            }
        };
        if drop_all {
            continue;
        }
        sent += n as u64;
        let buf = if kind == FrameKind::Stdout { &bo } else { &be };
        out.data(kind, id, Bytes::copy_from_slice(&buf[..n])).await;
    }
}

async fn stdin_pump<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    id: u32,
    out: Outbox,
) {
    let mut total = 0u64;
    let mut open = true;
    while let Some(b) = rx.recv().await {
        if open && w.write_all(&b).await.is_err() {
            // The process closed stdin; keep acking so the host does not stall.
            open = false;
        }
        total += b.len() as u64;
        out.msg(id, &Response::Ack { bytes: total }).await;
    }
    let _ = w.shutdown().await;
}

/// The reading and the writing end of a PTY master (non-blocking dups).
fn pty_ends(master: &OwnedFd) -> io::Result<(pipe::Receiver, pipe::Sender)> {
    let r = pipe::Receiver::from_owned_fd_unchecked(master.try_clone()?)?;
    let w = pipe::Sender::from_owned_fd_unchecked(master.try_clone()?)?;
    Ok((r, w))
}

/// Drives a started child to the end and sends `Exit`.
pub async fn run(
    spawned: Spawned,
    timeout: Option<Duration>,
    stdin_rx: Option<mpsc::UnboundedReceiver<Bytes>>,
    window: Option<Window>,
    slot: Slot,
) {
    let Spawned { mut child, pty } = spawned;
    let (id, out) = (slot.id, &slot.out);
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    let waiting = Arc::new(AtomicBool::new(false));
    let ends = match pty.as_deref().map(pty_ends) {
        Some(Ok(e)) => Some(e),
        Some(Err(e)) => {
            tracing::warn!(id, error = %e, "pty: cannot register the master");
            kill_group(pgid, libc::SIGKILL);
            None
        }
        None => None,
    };
    drop(pty);
    let mut output = match ends {
        Some((r, w)) => {
            if let Some(rx) = stdin_rx {
                tokio::spawn(stdin_pump(w, rx, id, out.clone()));
            }
            tokio::spawn(pump_output(
                Some(r),
                None::<tokio::process::ChildStderr>,
                id,
                out.clone(),
                window,
                waiting.clone(),
            ))
        }
        None => {
            if let (Some(w), Some(rx)) = (child.stdin.take(), stdin_rx) {
                tokio::spawn(stdin_pump(w, rx, id, out.clone()));
            }
            tokio::spawn(pump_output(
                child.stdout.take(),
                child.stderr.take(),
                id,
                out.clone(),
                window,
                waiting.clone(),
            ))
        }
    };
    let mut timed_out = false;
    let status = match timeout {
        None => child.wait().await,
        Some(t) => match tokio::time::timeout(t, child.wait()).await {
            Ok(s) => s,
            Err(_) => {
                timed_out = true;
                tracing::info!(id, pgid, "timeout: killing process group");
                kill_group(pgid, libc::SIGKILL);
                child.wait().await
            }
        },
    };
    // The grace counts only time spent reading: output held back for
    // credit is still delivered once the host reads it.
    let mut idle = Duration::ZERO;
    while tokio::time::timeout(GRACE_TICK, &mut output).await.is_err() {
        if !waiting.load(Ordering::SeqCst) {
            idle += GRACE_TICK;
        }
        if idle >= PIPE_GRACE {
            tracing::debug!(id, "output pipes still open after exit; not waiting");
            output.abort();
            break;
        }
    }
    let (code, signal) = match status {
        Ok(s) => (s.code(), s.signal()),
        Err(e) => {
            tracing::warn!(id, error = %e, "wait failed");
            (None, None)
        }
    };
    out.msg(
        id,
        &Response::Exit {
            code,
            signal,
            timed_out,
        },
    )
    .await;
    slot.release();
}
