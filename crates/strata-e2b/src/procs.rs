//! E2B process handles on top of strata's one-shot exec.
//!
//! envd keeps every process it started in a table by pid: clients attach
//! (`Connect`), list, signal, write to stdin after the start. strata's
//! service offers one call, `exec`, that runs a command and streams its
//! output to the one caller. This module builds the rest in the guest with
//! a small `sh` wrapper, run through that same exec:
//!
//! - the wrapper prints a marker line with its pid (`\x1estrata-e2b-pid N`)
//!   on stdout, then `exec`s the command: the pid is the command's, and
//!   since the agent starts every command in its own session, also its
//!   process group;
//! - with `stdin: true` the wrapper first makes a FIFO under
//!   `/tmp/.strata-e2b/`, starts a holder process (`sleep`) that keeps its
//!   write end open, and reads stdin from it: `SendInput` is another exec
//!   (`cat > fifo`), `CloseStdin` kills the holder (the reader sees EOF);
//! - signals are another exec, `kill -s SIG -- -PID` (the process group);
//! - one pump task per process reads the exec stream and fans the events
//!   out to the attached clients, so a process outlives the request that
//!   started it.
//!
//! A PTY process (`Start` with `pty`) needs no wrapper: it runs as an
//! interactive exec on a pseudo-terminal ([`start_pty`]); its pid is the
//! agent's `started` pid, its terminal output goes out as `pty` data, and
//! its input (`SendInput` with `pty` bytes) and window size (`Update`) go
//! down the exec's input channel, without an exec round trip each.
//!
//! Limits (a service-level process API would lift them): output is only
//! delivered live (no replay to a late `Connect`); when the sandbox
//! hibernates the exec stream ends, so a process that keeps running in the
//! woken guest is "detached": it is listed and can be signalled, a
//! `Connect` to it reports its end (polled) but not its output or exit code;
//! the table is in memory (a daemon restart forgets it); each signal, input
//! or close costs one exec round trip.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use strata_core::SandboxId;
use stratad::caller::Caller;
use stratad::engine::{
    AgentError, ExecEvent, ExecInput, ExecInputs, ExecRequest, ExecStream, PtySize, RuntimeError,
    Stdin,
};
use stratad::service::{Grant, Service};
use tokio::sync::mpsc;

use crate::connect::{Code, ConnectError};
use crate::error::service_err;
use crate::proto::{exit_status, ProcessConfig, ProcessEvent, ProcessInfo};

/// Guest directory of the FIFOs and holder pid files.
pub const GUEST_DIR: &str = "/tmp/.strata-e2b";

const MARKER: &[u8] = b"\x1estrata-e2b-pid ";

/// The wrapper: `sh -c WRAPPER strata-e2b <stdin 0|1> <cmd> <args…>`.
const WRAPPER: &str = r#"d=/tmp/.strata-e2b
if [ "$1" = 1 ]; then
  mkdir -p "$d" || exit 126
  f="$d/$$.stdin"
  rm -f "$f"
  mkfifo -m 600 "$f" || exit 126
  sleep 2147483647 >"$f" </dev/null 2>/dev/null &
  echo $! >"$d/$$.holder"
  exec <"$f"
else
  exec </dev/null
fi
shift
printf '\036strata-e2b-pid %s\n' "$$"
exec "$@"
"#;

/// The argv that runs `cmd args` under the wrapper.
pub fn wrapper_argv(stdin: bool, cmd: &str, args: &[String]) -> Vec<String> {
    let mut v = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        WRAPPER.to_owned(),
        "strata-e2b".to_owned(),
        if stdin { "1" } else { "0" }.to_owned(),
        cmd.to_owned(),
    ];
    v.extend(args.iter().cloned());
    v
}

/// Looks for the marker line at the start of `buf`: `Some(Ok((pid, rest)))`
/// when complete, `None` when more bytes are needed, `Some(Err)` when the
/// output does not start with the marker.
pub fn parse_marker(buf: &[u8]) -> Option<Result<(u32, &[u8]), ()>> {
    let n = buf.len().min(MARKER.len());
    if buf[..n] != MARKER[..n] {
        return Some(Err(()));
    }
    let nl = match buf.iter().position(|&b| b == b'\n') {
        Some(i) => i,
        None if buf.len() > 64 => return Some(Err(())),
        None => return None,
    };
    let num = buf.get(MARKER.len()..nl)?;
    let pid = std::str::from_utf8(num).ok().and_then(|s| s.parse().ok());
    Some(pid.map(|p| (p, &buf[nl + 1..])).ok_or(()))
}

#[derive(Debug, Default)]
struct ProcState {
    subscribers: Vec<mpsc::Sender<ProcessEvent>>,
    /// The exec stream still delivers this process's output.
    attached: bool,
}

/// A process started through envd.
#[derive(Debug)]
pub struct Proc {
    /// Pid in the guest.
    pub pid: u32,
    /// Caller's tag.
    pub tag: Option<String>,
    /// How it was started.
    pub config: ProcessConfig,
    /// Whether it reads stdin from a FIFO.
    pub stdin: bool,
    /// A PTY process's input channel (terminal bytes, resizes).
    pub pty: Option<ExecInputs>,
    state: Mutex<ProcState>,
}

impl Proc {
    /// Whether output is still delivered live.
    pub fn attached(&self) -> bool {
        self.lock().attached
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProcState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new client: it gets the events from now on (`None`: detached).
    pub fn subscribe(&self) -> Option<mpsc::Receiver<ProcessEvent>> {
        let mut s = self.lock();
        if !s.attached {
            return None;
        }
        let (tx, rx) = mpsc::channel(256);
        s.subscribers.push(tx);
        Some(rx)
    }

    async fn publish(&self, ev: ProcessEvent) {
        let subs = self.lock().subscribers.clone();
        for tx in subs {
            let _ = tx.send(ev.clone()).await;
        }
        self.lock().subscribers.retain(|t| !t.is_closed());
    }

    fn detach(&self) {
        let mut s = self.lock();
        s.attached = false;
        s.subscribers.clear();
    }

    /// Sends `input` to a PTY process: waits at most [`PTY_INPUT_WAIT`] for
    /// room (a process that does not read its terminal holds up its input).
    pub async fn pty_input(&self, input: ExecInput) -> Result<(), ConnectError> {
        let Some(tx) = &self.pty else {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} is not a PTY", self.pid),
            ));
        };
        match tx.send_timeout(input, PTY_INPUT_WAIT).await {
            Ok(()) => Ok(()),
            Err(mpsc::error::SendTimeoutError::Timeout(_)) => Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("the PTY of process {} is not taking input", self.pid),
            )),
            Err(mpsc::error::SendTimeoutError::Closed(_)) => Err(ConnectError::new(
                Code::FailedPrecondition,
                format!(
                    "the PTY of process {} is gone (it ended, or the sandbox was paused)",
                    self.pid
                ),
            )),
        }
    }

    /// The `ProcessInfo` of `List`.
    pub fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: self.config.clone(),
            pid: self.pid,
            tag: self.tag.clone(),
        }
    }
}

/// The processes started through envd, per sandbox.
#[derive(Debug, Default)]
pub struct Registry {
    map: Mutex<HashMap<SandboxId, HashMap<u32, Arc<Proc>>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, HashMap<u32, Arc<Proc>>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The processes of a sandbox.
    pub fn all(&self, id: &SandboxId) -> Vec<Arc<Proc>> {
        self.lock()
            .get(id)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// A process by pid or tag.
    pub fn find(&self, id: &SandboxId, pid: Option<u32>, tag: Option<&str>) -> Option<Arc<Proc>> {
        let g = self.lock();
        let m = g.get(id)?;
        match (pid, tag) {
            (Some(p), _) => m.get(&p).cloned(),
            (None, Some(t)) => m.values().find(|p| p.tag.as_deref() == Some(t)).cloned(),
            (None, None) => None,
        }
    }

    fn insert(&self, id: &SandboxId, p: Arc<Proc>) {
        self.lock().entry(id.clone()).or_default().insert(p.pid, p);
    }

    /// Drops a process (it ended).
    pub fn remove(&self, id: &SandboxId, pid: u32) {
        let mut g = self.lock();
        if let Some(m) = g.get_mut(id) {
            m.remove(&pid);
            if m.is_empty() {
                g.remove(id);
            }
        }
    }

    /// Forgets a deleted sandbox's processes.
    pub fn forget_sandbox(&self, id: &SandboxId) {
        if let Some(m) = self.lock().remove(id) {
            m.values().for_each(|p| p.detach());
        }
    }

    /// Marks a sandbox's processes detached (it hibernated: the exec streams end).
    pub fn detach_sandbox(&self, id: &SandboxId) {
        for p in self.all(id) {
            p.detach();
        }
    }
}

/// Most output (stdout and stderr together) a helper command may produce;
/// more fails the helper with `resource_exhausted` (its exec is dropped, so
/// the guest discards the rest; the helper's timeout ends it).
pub const HELPER_OUTPUT_LIMIT: usize = 1024 * 1024;

/// Stdout and stderr of a helper, at most `limit` bytes together.
#[derive(Debug, Default)]
struct Collected {
    out: Vec<u8>,
    err: Vec<u8>,
}

impl Collected {
    fn push(&mut self, stderr: bool, b: &[u8], limit: usize) -> Result<(), ConnectError> {
        if self.out.len() + self.err.len() + b.len() > limit {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("the helper command's output exceeds {limit} bytes"),
            ));
        }
        if stderr { &mut self.err } else { &mut self.out }.extend_from_slice(b);
        Ok(())
    }
}

/// Runs a short helper command in the guest under grant `g` (the call it
/// serves was decided already) and collects it (at most
/// [`HELPER_OUTPUT_LIMIT`] bytes).
pub async fn run_helper(
    svc: &Arc<Service>,
    g: &Grant,
    argv: Vec<String>,
    stdin: Option<Vec<u8>>,
    timeout_s: u64,
) -> Result<(Option<i32>, Vec<u8>, Vec<u8>), ConnectError> {
    let mut s = svc
        .exec_helper(
            g,
            ExecRequest {
                stdin: stdin.map_or(Stdin::Null, Stdin::Bytes),
                timeout: Some(Duration::from_secs(timeout_s)),
                ..ExecRequest::argv(argv)
            },
        )
        .await
        .map_err(service_err)?;
    let mut got = Collected::default();
    while let Some(ev) = s.next().await {
        match ev.map_err(|e| ConnectError::new(Code::Unavailable, e.message()))? {
            ExecEvent::Started { .. } => {}
            ExecEvent::Stdout(b) => got.push(false, &b, HELPER_OUTPUT_LIMIT)?,
            ExecEvent::Stderr(b) => got.push(true, &b, HELPER_OUTPUT_LIMIT)?,
            ExecEvent::Exit(s) => return Ok((s.code, got.out, got.err)),
        }
    }
    Err(ConnectError::new(
        Code::Unavailable,
        "the command's stream ended without an exit status",
    ))
}

/// Which of `pids` still run in the guest.
pub async fn alive(svc: &Arc<Service>, g: &Grant, pids: &[u32]) -> Result<Vec<u32>, ConnectError> {
    if pids.is_empty() {
        return Ok(Vec::new());
    }
    let mut argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        // A zombie counts as gone.
        r#"for p in "$@"; do [ -d /proc/$p ] && ! grep -q '^State:[[:space:]]*Z' /proc/$p/status 2>/dev/null && echo $p; done; true"#.to_owned(),
        "alive".to_owned(),
    ];
    argv.extend(pids.iter().map(|p| p.to_string()));
    let (_, out, _) = run_helper(svc, g, argv, None, 10).await?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect())
}

/// What [`start`] returns: the process and the starter's event receiver.
pub type Started = (Arc<Proc>, mpsc::Receiver<ProcessEvent>);

/// Starts a process under `g`, the exec grant of its argv: runs the
/// wrapper, waits for its pid, registers it and spawns the pump that
/// delivers its events. `user`: who the command runs as (`None`: root).
#[allow(clippy::too_many_arguments)]
pub async fn start(
    svc: &Arc<Service>,
    reg: &Arc<Registry>,
    g: &Grant,
    config: ProcessConfig,
    env: std::collections::BTreeMap<String, String>,
    tag: Option<String>,
    stdin: bool,
    user: Option<String>,
) -> Result<Started, ConnectError> {
    let id = g.sandbox();
    let argv = wrapper_argv(stdin, &config.cmd, &config.args);
    let mut shown = vec![config.cmd.clone()];
    shown.extend(config.args.iter().cloned());
    let mut stream = svc
        .exec_helper_logged(
            g,
            ExecRequest {
                env,
                cwd: config.cwd.clone(),
                user,
                ..ExecRequest::argv(argv)
            },
            stratad::engine::Command::Argv(shown),
        )
        .await
        .map_err(service_err)?;
    let mut head = Vec::new();
    let mut early_err = Vec::new();
    let (pid, rest) = loop {
        match stream.next().await {
            Some(Ok(ExecEvent::Stdout(b))) => {
                head.extend_from_slice(&b);
                match parse_marker(&head) {
                    None => continue,
                    Some(Ok((pid, rest))) => break (pid, rest.to_vec()),
                    Some(Err(())) => {
                        return Err(ConnectError::new(
                            Code::Internal,
                            "the process wrapper did not report a pid",
                        ))
                    }
                }
            }
            Some(Ok(ExecEvent::Started { .. })) => {}
            Some(Ok(ExecEvent::Stderr(b))) => early_err.extend_from_slice(&b),
            Some(Ok(ExecEvent::Exit(s))) => {
                let (c, status) = exit_status(s.code, s.signal);
                return Err(ConnectError::new(
                    if c == 126 {
                        Code::FailedPrecondition
                    } else {
                        Code::Unknown
                    },
                    format!(
                        "the process did not start ({status}): {}",
                        String::from_utf8_lossy(&early_err).trim()
                    ),
                ));
            }
            Some(Err(e)) => return Err(ConnectError::new(Code::Unavailable, e.message())),
            None => {
                return Err(ConnectError::new(
                    Code::Unavailable,
                    "the exec stream ended before the process started",
                ))
            }
        }
    };
    let proc = Arc::new(Proc {
        pid,
        tag,
        config,
        stdin,
        pty: None,
        state: Mutex::new(ProcState {
            subscribers: Vec::new(),
            attached: true,
        }),
    });
    let rx = proc
        .subscribe()
        .ok_or_else(|| ConnectError::new(Code::Internal, "process detached before it started"))?;
    reg.insert(id, proc.clone());
    let mut first = Vec::new();
    if !early_err.is_empty() {
        first.push(ProcessEvent::Stderr(early_err));
    }
    if !rest.is_empty() {
        first.push(ProcessEvent::Stdout(rest));
    }
    tokio::spawn(pump(
        svc.clone(),
        reg.clone(),
        g.caller().clone(),
        id.clone(),
        proc.clone(),
        stream,
        first,
    ));
    Ok((proc, rx))
}

async fn pump(
    svc: Arc<Service>,
    reg: Arc<Registry>,
    caller: Caller,
    id: SandboxId,
    proc: Arc<Proc>,
    mut stream: ExecStream,
    first: Vec<ProcessEvent>,
) {
    for ev in first {
        proc.publish(ev).await;
    }
    loop {
        match stream.next().await {
            Some(Ok(ExecEvent::Started { .. })) => {}
            Some(Ok(ExecEvent::Stdout(b))) if proc.pty.is_some() => {
                proc.publish(ProcessEvent::Pty(b.to_vec())).await
            }
            Some(Ok(ExecEvent::Stdout(b))) => proc.publish(ProcessEvent::Stdout(b.to_vec())).await,
            Some(Ok(ExecEvent::Stderr(b))) => proc.publish(ProcessEvent::Stderr(b.to_vec())).await,
            Some(Ok(ExecEvent::Exit(s))) => {
                let (exit_code, status) = exit_status(s.code, s.signal);
                reg.remove(&id, proc.pid);
                proc.publish(ProcessEvent::End {
                    exit_code,
                    exited: s.code.is_some(),
                    status,
                    error: None,
                })
                .await;
                proc.detach();
                if proc.stdin {
                    let argv = vec![
                        "/bin/sh".to_owned(),
                        "-c".to_owned(),
                        r#"h="$0/$1.holder"; [ -f "$h" ] && kill "$(cat "$h")" 2>/dev/null; rm -f "$h" "$0/$1.stdin"; true"#.to_owned(),
                        GUEST_DIR.to_owned(),
                        proc.pid.to_string(),
                    ];
                    let cleanup = async {
                        let g = svc.access(&caller, &id).await.map_err(service_err)?;
                        run_helper(&svc, &g, argv, None, 10).await
                    };
                    if let Err(e) = cleanup.await {
                        tracing::debug!(sandbox = %id, pid = proc.pid, error = %e, "stdin cleanup failed");
                    }
                }
                return;
            }
            Some(Err(e)) => {
                // The VM went away under the stream (hibernation, death):
                // the process may live on in the woken guest.
                tracing::info!(sandbox = %id, pid = proc.pid, error = %e.message(), "process output detached");
                proc.detach();
                return;
            }
            None => {
                proc.detach();
                return;
            }
        }
    }
}

/// Sends signal `sig` to the process group of `pid`.
pub async fn signal(svc: &Arc<Service>, g: &Grant, pid: u32, sig: i32) -> Result<(), ConnectError> {
    let argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        r#"kill -s "$0" -- "-$1" 2>/dev/null || kill -s "$0" "$1""#.to_owned(),
        if sig == 9 { "KILL" } else { "TERM" }.to_owned(),
        pid.to_string(),
    ];
    let (code, _, err) = run_helper(svc, g, argv, None, 10).await?;
    if code != Some(0) {
        return Err(ConnectError::new(
            Code::NotFound,
            format!(
                "process {pid} not found: {}",
                String::from_utf8_lossy(&err).trim()
            ),
        ));
    }
    Ok(())
}

/// Writes `data` to the stdin FIFO of `pid`.
pub async fn send_input(
    svc: &Arc<Service>,
    g: &Grant,
    pid: u32,
    data: Vec<u8>,
) -> Result<(), ConnectError> {
    let argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        r#"f="$0/$1.stdin"; [ -p "$f" ] || exit 3; cat >"$f""#.to_owned(),
        GUEST_DIR.to_owned(),
        pid.to_string(),
    ];
    match run_helper(svc, g, argv, Some(data), 30).await?.0 {
        Some(0) => Ok(()),
        Some(3) => Err(ConnectError::new(
            Code::FailedPrecondition,
            format!("process {pid} has no open stdin (start it with stdin=True)"),
        )),
        other => Err(ConnectError::new(
            Code::Unknown,
            format!("writing to the stdin of {pid} failed ({other:?})"),
        )),
    }
}

/// Closes the stdin of `pid` (the reader sees EOF once the FIFO drains).
pub async fn close_stdin(svc: &Arc<Service>, g: &Grant, pid: u32) -> Result<(), ConnectError> {
    let argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        r#"h="$0/$1.holder"; [ -f "$h" ] || exit 3; kill "$(cat "$h")"; rm -f "$h""#.to_owned(),
        GUEST_DIR.to_owned(),
        pid.to_string(),
    ];
    match run_helper(svc, g, argv, None, 10).await?.0 {
        Some(0) => Ok(()),
        _ => Err(ConnectError::new(
            Code::FailedPrecondition,
            format!("process {pid} has no open stdin"),
        )),
    }
}

/// Longest a PTY's input waits for room in its queue.
pub const PTY_INPUT_WAIT: Duration = Duration::from_secs(10);

/// A PTY size from envd's message: both sides 1..=`MAX_PTY_SIDE`.
pub fn pty_size(p: Option<&crate::proto::Pty>) -> Result<PtySize, ConnectError> {
    let max = u32::from(stratad::service::MAX_PTY_SIDE);
    match p.and_then(|p| p.size) {
        Some(s) if (1..=max).contains(&s.cols) && (1..=max).contains(&s.rows) => Ok(PtySize {
            cols: s.cols as u16,
            rows: s.rows as u16,
        }),
        Some(s) => Err(ConnectError::new(
            Code::InvalidArgument,
            format!(
                "pty.size: cols and rows must be 1..={max} (got {}x{})",
                s.cols, s.rows
            ),
        )),
        None => Err(ConnectError::new(
            Code::InvalidArgument,
            "pty.size is missing",
        )),
    }
}

/// Starts a PTY process under `g`, the exec grant of its argv: an
/// interactive exec on a terminal of `size`; registers it and spawns its
/// pump. `user`: who it runs as (`None`: root).
#[allow(clippy::too_many_arguments)]
pub async fn start_pty(
    svc: &Arc<Service>,
    reg: &Arc<Registry>,
    g: &Grant,
    config: ProcessConfig,
    env: std::collections::BTreeMap<String, String>,
    tag: Option<String>,
    size: PtySize,
    user: Option<String>,
) -> Result<Started, ConnectError> {
    let id = g.sandbox();
    let argv: Vec<String> = std::iter::once(config.cmd.clone())
        .chain(config.args.iter().cloned())
        .collect();
    let (mut stream, input) = svc
        .exec_helper_interactive(
            g,
            ExecRequest {
                env,
                cwd: config.cwd.clone(),
                user,
                stdin: Stdin::Stream,
                pty: Some(size),
                ..ExecRequest::argv(argv)
            },
        )
        .await
        .map_err(service_err)?;
    let mut first = Vec::new();
    let pid = loop {
        match stream.next().await {
            Some(Ok(ExecEvent::Started { pid })) => break pid,
            Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b))) => {
                first.push(ProcessEvent::Pty(b.to_vec()))
            }
            Some(Ok(ExecEvent::Exit(_))) | None => {
                return Err(ConnectError::new(
                    Code::Unavailable,
                    "the exec stream ended before the PTY process started",
                ))
            }
            Some(Err(
                e @ RuntimeError::Agent {
                    source: AgentError::Unsupported { .. },
                    ..
                },
            )) => return Err(ConnectError::new(Code::Unimplemented, e.message())),
            Some(Err(e)) => return Err(service_err(e.into())),
        }
    };
    let proc = Arc::new(Proc {
        pid,
        tag,
        config,
        stdin: false,
        pty: Some(input),
        state: Mutex::new(ProcState {
            subscribers: Vec::new(),
            attached: true,
        }),
    });
    let rx = proc
        .subscribe()
        .ok_or_else(|| ConnectError::new(Code::Internal, "process detached before it started"))?;
    reg.insert(id, proc.clone());
    tokio::spawn(pump(
        svc.clone(),
        reg.clone(),
        g.caller().clone(),
        id.clone(),
        proc.clone(),
        stream,
        first,
    ));
    Ok((proc, rx))
}

/// How often a detached process is polled by `Connect`.
pub const DETACHED_POLL: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_parsing() {
        assert_eq!(
            parse_marker(b"\x1estrata-e2b-pid 42\nhello"),
            Some(Ok((42, &b"hello"[..])))
        );
        assert_eq!(parse_marker(b"\x1estrata-e2b-pid 4"), None);
        assert_eq!(parse_marker(b"\x1estrata"), None);
        assert_eq!(parse_marker(b"hello\n"), Some(Err(())));
        assert_eq!(parse_marker(b"\x1estrata-e2b-pid x\n"), Some(Err(())));
    }

    #[test]
    fn helper_output_is_capped() {
        let mut c = Collected::default();
        c.push(false, b"12345", 8).unwrap();
        c.push(true, b"678", 8).unwrap();
        let e = c.push(false, b"9", 8).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert_eq!(
            (c.out.as_slice(), c.err.as_slice()),
            (&b"12345"[..], &b"678"[..])
        );
    }

    #[test]
    fn wrapper_argv_keeps_the_command_verbatim() {
        let v = wrapper_argv(
            true,
            "/bin/bash",
            &["-l".into(), "-c".into(), "echo 'a b'".into()],
        );
        assert_eq!(v[0], "/bin/sh");
        assert_eq!(v[4], "1");
        assert_eq!(&v[5..], ["/bin/bash", "-l", "-c", "echo 'a b'"]);
    }

    #[tokio::test]
    async fn wrapper_runs_on_this_host() {
        // The wrapper is plain POSIX sh: check it here with the host's sh.
        let out = tokio::process::Command::new("/bin/sh")
            .args(
                &wrapper_argv(
                    false,
                    "/bin/sh",
                    &["-c".into(), "echo out; echo err >&2; exit 3".into()],
                )[1..],
            )
            .output()
            .await
            .unwrap();
        let (pid, rest) = parse_marker(&out.stdout).unwrap().unwrap();
        assert!(pid > 1);
        assert_eq!(rest, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert_eq!(out.status.code(), Some(3));
    }

    #[tokio::test]
    async fn subscribers_get_events_until_detached() {
        let p = Proc {
            pid: 1,
            tag: None,
            config: ProcessConfig::default(),
            stdin: false,
            pty: None,
            state: Mutex::new(ProcState {
                subscribers: Vec::new(),
                attached: true,
            }),
        };
        let mut a = p.subscribe().unwrap();
        p.publish(ProcessEvent::Stdout(b"x".to_vec())).await;
        assert_eq!(a.recv().await, Some(ProcessEvent::Stdout(b"x".to_vec())));
        p.detach();
        assert_eq!(a.recv().await, None);
        assert!(p.subscribe().is_none());
    }
}
