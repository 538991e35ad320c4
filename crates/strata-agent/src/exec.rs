//! Running commands: own process group, optional user, streamed output,
//! timeout that kills the whole group.
//!
//! Output flow control (see `PROTOCOL.md`, *Flow control*): when the session
//! windows output, one task reads both pipes and never has more than the
//! window of stdout and stderr together sent and not acknowledged; with the
//! credit used up it stops reading, so the command blocks on its next write.
//! When the host discards the output, or the session ends, the task keeps
//! reading and drops what it reads, so the command runs on.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use strata_proto::frame::FrameKind;
use strata_proto::{Command, RemoteErrorKind, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
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
}

/// Spawns the process (in its own session / process group).
pub fn spawn(spec: &Spec) -> Result<Child, Fail> {
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
    let mut cmd = tokio::process::Command::new(&prog);
    cmd.args(&args)
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("LANG", "C.UTF-8")
        .stdin(if spec.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
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
    // async-signal-safe system calls (setsid, setgroups, setgid, setuid) on
    // data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
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
    cmd.spawn().map_err(|e| {
        let kind = match e.kind() {
            std::io::ErrorKind::NotFound => RemoteErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => RemoteErrorKind::PermissionDenied,
            _ => RemoteErrorKind::SpawnFailed,
        };
        Fail::new(kind, format!("cannot start {prog:?}: {e}"))
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

async fn stdin_pump(
    mut w: tokio::process::ChildStdin,
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

/// Drives a started child to the end and sends `Exit`.
pub async fn run(
    mut child: Child,
    timeout: Option<Duration>,
    stdin_rx: Option<mpsc::UnboundedReceiver<Bytes>>,
    window: Option<Window>,
    slot: Slot,
) {
    let (id, out) = (slot.id, &slot.out);
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    let waiting = Arc::new(AtomicBool::new(false));
    let mut output = tokio::spawn(pump_output(
        child.stdout.take(),
        child.stderr.take(),
        id,
        out.clone(),
        window,
        waiting.clone(),
    ));
    if let (Some(w), Some(rx)) = (child.stdin.take(), stdin_rx) {
        tokio::spawn(stdin_pump(w, rx, id, out.clone()));
    }
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
