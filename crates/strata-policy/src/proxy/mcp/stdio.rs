//! A stdio MCP server the daemon runs on the host for one gateway session:
//! newline-delimited JSON-RPC on its stdin/stdout, bounded (a line over
//! [`MAX_UPSTREAM_MESSAGE`] kills it), killed when its session ends, when
//! it is idle, or with the sandbox's proxy (`kill_on_drop`).

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::rpc::{self, MAX_UPSTREAM_MESSAGE};

/// Bytes of a server's stderr kept (the last ones) for the log.
const STDERR_TAIL: usize = 4096;

/// What a waiting request receives: the server's notifications, then its
/// response.
pub(super) type Inbox = mpsc::UnboundedReceiver<Value>;

struct Waiter {
    tx: mpsc::UnboundedSender<Value>,
    token: Option<Value>,
}

/// One running stdio server.
pub(super) struct StdioServer {
    stdin: tokio::sync::Mutex<ChildStdin>,
    child: Mutex<Option<Child>>,
    waiters: Arc<Mutex<HashMap<String, Waiter>>>,
    last_used: Mutex<Instant>,
    alive: Arc<std::sync::atomic::AtomicBool>,
}

impl StdioServer {
    /// Starts `command` with only `env` (plus `PATH`, `HOME`, `LANG` of the
    /// daemon) in its environment.
    pub(super) fn spawn(
        command: &[String],
        env: &BTreeMap<String, String>,
    ) -> std::io::Result<Arc<StdioServer>> {
        let (prog, args) = command
            .split_first()
            .ok_or_else(|| std::io::Error::other("empty command"))?;
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for k in ["PATH", "HOME", "LANG"] {
            if let Ok(v) = std::env::var(k) {
                cmd.env(k, v);
            }
        }
        cmd.envs(env);
        let mut child = cmd.spawn()?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("no stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
        let stderr = child.stderr.take();
        let waiters: Arc<Mutex<HashMap<String, Waiter>>> = Arc::default();
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let s = Arc::new(StdioServer {
            stdin: tokio::sync::Mutex::new(stdin),
            child: Mutex::new(Some(child)),
            waiters: waiters.clone(),
            last_used: Mutex::new(Instant::now()),
            alive: alive.clone(),
        });
        let weak = Arc::downgrade(&s);
        let prog_name = prog.clone();
        tokio::spawn(async move {
            let mut r = BufReader::new(stdout);
            loop {
                let mut line = Vec::new();
                let n = (&mut r)
                    .take(MAX_UPSTREAM_MESSAGE as u64 + 1)
                    .read_until(b'\n', &mut line)
                    .await;
                match n {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line.len() > MAX_UPSTREAM_MESSAGE => {
                        tracing::warn!(program = %prog_name, "stdio MCP server wrote an over-long line; stopped");
                        break;
                    }
                    Ok(_) => {}
                }
                let Ok(v) = serde_json::from_slice::<Value>(&line) else {
                    continue;
                };
                let Some(s) = weak.upgrade() else { break };
                s.dispatch(v).await;
            }
            alive.store(false, std::sync::atomic::Ordering::SeqCst);
            // Wake everyone still waiting: their sender goes.
            waiters.lock().unwrap_or_else(|e| e.into_inner()).clear();
            if let Some(s) = weak.upgrade() {
                s.kill();
            }
        });
        if let Some(mut err) = stderr {
            let prog = prog.clone();
            tokio::spawn(async move {
                let mut tail: Vec<u8> = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = err.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    tail.extend_from_slice(&buf[..n]);
                    if tail.len() > STDERR_TAIL {
                        tail.drain(..tail.len() - STDERR_TAIL);
                    }
                }
                if !tail.is_empty() {
                    tracing::debug!(program = %prog, stderr = %strata_core::text::Escaped(&String::from_utf8_lossy(&tail)), "stdio MCP server stderr (tail)");
                }
            });
        }
        Ok(s)
    }

    async fn dispatch(&self, v: Value) {
        let has_method = v.get("method").is_some();
        let id = v.get("id").cloned();
        match (has_method, id) {
            // A request from the server (sampling, roots, elicitation):
            // not offered through the gateway.
            (true, Some(id)) => {
                let e = rpc::error(
                    &id,
                    rpc::METHOD_NOT_FOUND,
                    "server-to-client requests are not offered through the strata MCP gateway",
                    None,
                );
                let _ = self.write(&e).await;
            }
            // A notification: to the request whose progress token it names,
            // else to any waiting request.
            (true, None) => {
                let token = v
                    .get("params")
                    .and_then(|p| p.get("progressToken"))
                    .cloned();
                let w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
                let target = w
                    .values()
                    .find(|x| token.is_some() && x.token == token)
                    .or_else(|| w.values().next());
                if let Some(t) = target {
                    let _ = t.tx.send(v);
                }
            }
            (false, Some(id)) => {
                let key = id.to_string();
                let w = self
                    .waiters
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&key);
                if let Some(w) = w {
                    let _ = w.tx.send(v);
                }
            }
            (false, None) => {}
        }
    }

    /// Writes one message.
    pub(super) async fn write(&self, v: &Value) -> std::io::Result<()> {
        *self.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        let mut line = serde_json::to_vec(v).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut w = self.stdin.lock().await;
        w.write_all(&line).await?;
        w.flush().await
    }

    /// Sends the request `v` (id `id`) and returns where its notifications
    /// and response arrive (the channel closes if the server dies).
    pub(super) async fn request(
        &self,
        id: &Value,
        token: Option<Value>,
        v: &Value,
    ) -> std::io::Result<Inbox> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), Waiter { tx, token });
        if let Err(e) = self.write(v).await {
            self.waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id.to_string());
            return Err(e);
        }
        Ok(rx)
    }

    /// Counts as used now (a call held for approval keeps its session's
    /// server from being stopped as idle).
    pub(super) fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Whether the process still runs.
    pub(super) fn is_alive(&self) -> bool {
        self.alive.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Idle for longer than `d` with no request waiting.
    pub(super) fn idle_for(&self, d: Duration) -> bool {
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
            && self
                .last_used
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                > d
    }

    /// Kills the process (and reaps it in the background).
    pub(super) fn kill(&self) {
        self.alive.store(false, std::sync::atomic::Ordering::SeqCst);
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut c) = child {
            let _ = c.start_kill();
            // Reaped in the background when a runtime is there (always,
            // but at the daemon's very end, where the process goes anyway).
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = c.wait().await;
                });
            }
        }
    }
}

impl Drop for StdioServer {
    fn drop(&mut self) {
        self.kill();
    }
}
