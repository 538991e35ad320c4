//! Running commands: own process group, optional user, streamed output,
//! timeout that kills the whole group.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use strata_proto::frame::FrameKind;
use strata_proto::{Command, RemoteErrorKind, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;
use tokio::sync::mpsc;

use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::Slot;
use crate::user;

/// Output chunk size.
const OUT_CHUNK: usize = 64 * 1024;
/// How long to wait for output pipes after the leader exited (background
/// children may hold them open).
const PIPE_GRACE: Duration = Duration::from_millis(500);

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

async fn pump<R: AsyncRead + Unpin>(mut r: R, kind: FrameKind, id: u32, out: Outbox) {
    let mut buf = vec![0u8; OUT_CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => out.data(kind, id, Bytes::copy_from_slice(&buf[..n])).await,
        }
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
    slot: Slot,
) {
    let (id, out) = (slot.id, &slot.out);
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    let mut pumps = Vec::new();
    if let Some(o) = child.stdout.take() {
        pumps.push(tokio::spawn(pump(o, FrameKind::Stdout, id, out.clone())));
    }
    if let Some(e) = child.stderr.take() {
        pumps.push(tokio::spawn(pump(e, FrameKind::Stderr, id, out.clone())));
    }
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
    let aborts: Vec<_> = pumps.iter().map(|h| h.abort_handle()).collect();
    if tokio::time::timeout(PIPE_GRACE, futures_join(pumps))
        .await
        .is_err()
    {
        tracing::debug!(id, "output pipes still open after exit; not waiting");
        aborts.iter().for_each(|a| a.abort());
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

async fn futures_join(handles: Vec<tokio::task::JoinHandle<()>>) {
    for h in handles {
        let _ = h.await;
    }
}
