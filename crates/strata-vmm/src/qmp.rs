//! A small async QMP client over a unix socket.
//!
//! Written here rather than taken from a crate: the published QMP crates are either
//! synchronous (`qapi` with its generated command set is large and tied to a QEMU
//! version) or unmaintained, and what strata needs is small: the greeting,
//! `qmp_capabilities`, commands matched to replies by `id`, buffered events,
//! timeouts, and passing a file descriptor with `SCM_RIGHTS` for `getfd`.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

/// How many events are kept for [`QmpClient::events`].
const EVENT_BUFFER: usize = 256;

/// Errors of the QMP client.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Connecting to the QMP socket failed.
    #[error("cannot connect to QMP socket {path:?}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP socket I/O")]
    Io(#[from] std::io::Error),
    /// QEMU closed the connection (usually: the process exited).
    #[error("QMP connection closed by QEMU")]
    Closed,
    /// QEMU sent something that is not QMP.
    #[error("unexpected QMP message: {0}")]
    Protocol(String),
    /// No reply arrived in time.
    #[error("QMP command {command} timed out after {secs:.1} s")]
    Timeout {
        /// The command that was sent.
        command: String,
        /// The timeout, in seconds.
        secs: f64,
    },
    /// QEMU answered the command with an error.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command that was sent.
        command: String,
        /// QEMU's error class (e.g. `GenericError`, `CommandNotFound`).
        class: String,
        /// QEMU's human-readable description.
        desc: String,
    },
}

/// An asynchronous event sent by QEMU (e.g. `SHUTDOWN`, `STOP`, `MIGRATION`).
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    /// Event name.
    pub event: String,
    /// Event payload (`Value::Null` when absent).
    pub data: Value,
}

#[derive(Deserialize)]
struct QmpErrorBody {
    class: String,
    desc: String,
}

type Pending = HashMap<u64, oneshot::Sender<Result<Value, QmpError>>>;

struct Shared {
    pending: Mutex<Pending>,
    events: Mutex<VecDeque<QmpEvent>>,
    closed: Mutex<bool>,
}

/// A connected QMP client. Cheap to share behind an `Arc`; commands may be sent concurrently.
pub struct QmpClient {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    event_tx: broadcast::Sender<QmpEvent>,
    timeout: Duration,
    reader: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient").finish_non_exhaustive()
    }
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means another task panicked while holding it; the data
    // (maps and queues) stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QmpClient {
    /// Connects to `path`, reads the greeting and negotiates capabilities.
    /// `timeout` applies to the handshake and is the default for every command.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let (read_half, write_half) = stream.into_split();
        let mut lines = BufReader::new(read_half).lines();
        let greeting = tokio::time::timeout(timeout, lines.next_line())
            .await
            .map_err(|_| QmpError::Timeout {
                command: "greeting".into(),
                secs: timeout.as_secs_f64(),
            })??
            .ok_or(QmpError::Closed)?;
        let greeting: Value = serde_json::from_str(&greeting)
            .map_err(|e| QmpError::Protocol(format!("greeting is not JSON: {e}")))?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("no QMP greeting: {greeting}")));
        }
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            events: Mutex::new(VecDeque::new()),
            closed: Mutex::new(false),
        });
        let (event_tx, _) = broadcast::channel(EVENT_BUFFER);
        let reader = tokio::spawn(read_loop(lines, shared.clone(), event_tx.clone()));
        let client = QmpClient {
            writer: tokio::sync::Mutex::new(write_half),
            shared,
            next_id: AtomicU64::new(1),
            event_tx,
            timeout,
            reader,
        };
        client.execute("qmp_capabilities", None).await?;
        Ok(client)
    }

    /// Runs `command` with optional `arguments` and returns its `return` value.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        self.execute_with_timeout(command, arguments, self.timeout)
            .await
    }

    /// Like [`execute`](Self::execute) with an explicit timeout.
    pub async fn execute_with_timeout(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, timeout, None).await
    }

    /// Runs `command` while passing `fd` to QEMU as `SCM_RIGHTS` ancillary data
    /// on the same message (what `getfd` and `add-fd` expect).
    pub async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, self.timeout, Some(fd))
            .await
    }

    async fn execute_inner(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        let (tx, rx) = oneshot::channel();
        {
            if *lock(&self.shared.closed) {
                return Err(QmpError::Closed);
            }
            lock(&self.shared.pending).insert(id, tx);
        }
        let sent = {
            let mut w = self.writer.lock().await;
            match fd {
                None => w.write_all(line.as_bytes()).await,
                Some(fd) => send_with_fd(&w, line.as_bytes(), fd).await,
            }
        };
        if let Err(e) = sent {
            lock(&self.shared.pending).remove(&id);
            return Err(e.into());
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => {
                lock(&self.shared.pending).remove(&id);
                Err(QmpError::Timeout {
                    command: command.into(),
                    secs: timeout.as_secs_f64(),
                })
            }
            Ok(Err(_)) => Err(QmpError::Closed),
            Ok(Ok(Err(QmpError::Command { class, desc, .. }))) => Err(QmpError::Command {
                command: command.into(),
                class,
                desc,
            }),
            Ok(Ok(r)) => r,
        }
    }

    /// All events received so far and not yet taken (oldest first, at most 256 kept).
    pub fn take_events(&self) -> Vec<QmpEvent> {
        lock(&self.shared.events).drain(..).collect()
    }

    /// A copy of the buffered events, without removing them.
    pub fn events(&self) -> Vec<QmpEvent> {
        lock(&self.shared.events).iter().cloned().collect()
    }

    /// A live stream of events received from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<QmpEvent> {
        self.event_tx.subscribe()
    }

    /// Whether QEMU closed the connection.
    pub fn is_closed(&self) -> bool {
        *lock(&self.shared.closed)
    }
}

async fn send_with_fd(w: &OwnedWriteHalf, data: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let stream: &UnixStream = w.as_ref();
    let raw = [fd.as_raw_fd()];
    let mut off = 0;
    while off < data.len() {
        stream.writable().await?;
        let first = off == 0;
        let res = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let iov = [IoSlice::new(&data[off..])];
            let cmsgs_fd = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage<'_>] = if first { &cmsgs_fd } else { &[] };
            sendmsg::<()>(stream.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None)
                .map_err(std::io::Error::from)
        });
        match res {
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn read_loop(
    mut lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    shared: Arc<Shared>,
    event_tx: broadcast::Sender<QmpEvent>,
) {
    loop {
        let line = match lines.next_line().await {
            Ok(Some(l)) => l,
            Ok(None) | Err(_) => break,
        };
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring non-JSON QMP line");
                continue;
            }
        };
        if let Some(ev) = msg.get("event").and_then(Value::as_str) {
            let event = QmpEvent {
                event: ev.to_owned(),
                data: msg.get("data").cloned().unwrap_or(Value::Null),
            };
            tracing::debug!(event = %event.event, data = %event.data, "QMP event");
            {
                let mut q = lock(&shared.events);
                if q.len() >= EVENT_BUFFER {
                    q.pop_front();
                }
                q.push_back(event.clone());
            }
            let _ = event_tx.send(event);
            continue;
        }
        let Some(id) = msg.get("id").and_then(Value::as_u64) else {
            tracing::warn!(%msg, "QMP reply without a numeric id");
            continue;
        };
        let Some(tx) = lock(&shared.pending).remove(&id) else {
            continue; // timed out earlier
        };
        let result = if let Some(ret) = msg.get("return") {
            Ok(ret.clone())
        } else if let Some(err) = msg.get("error") {
            match serde_json::from_value::<QmpErrorBody>(err.clone()) {
                Ok(e) => Err(QmpError::Command {
                    command: String::new(),
                    class: e.class,
                    desc: e.desc,
                }),
                Err(_) => Err(QmpError::Protocol(format!("malformed error: {err}"))),
            }
        } else {
            Err(QmpError::Protocol(format!(
                "reply without return/error: {msg}"
            )))
        };
        let _ = tx.send(result);
    }
    *lock(&shared.closed) = true;
    // Dropping the senders wakes every waiter with `Closed`.
    lock(&shared.pending).clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixListener;

    /// A scripted QMP server: greeting, then answers each command by name.
    async fn fake_server(listener: UnixListener) {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        loop {
            let n = s.read(&mut chunk).await.unwrap();
            if n == 0 {
                return;
            }
            buf.extend_from_slice(&chunk[..n]);
            while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let v: Value = serde_json::from_slice(&line).unwrap();
                let id = v["id"].clone();
                let reply = match v["execute"].as_str().unwrap() {
                    "qmp_capabilities" => json!({"return": {}, "id": id}),
                    "query-status" => {
                        s.write_all(b"{\"event\": \"STOP\", \"data\": {}}\n")
                            .await
                            .unwrap();
                        json!({"return": {"status": "paused", "running": false}, "id": id})
                    }
                    "hang" => continue,
                    "bye" => return,
                    _ => json!({"error": {"class": "CommandNotFound", "desc": "nope"}, "id": id}),
                };
                s.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
            }
        }
    }

    #[tokio::test]
    async fn commands_errors_events_timeouts_and_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(fake_server(listener));
        let c = QmpClient::connect(&path, Duration::from_secs(2))
            .await
            .unwrap();
        let st = c.execute("query-status", None).await.unwrap();
        assert_eq!(st["status"], "paused");
        assert_eq!(c.events()[0].event, "STOP");
        match c.execute("frobnicate", None).await {
            Err(QmpError::Command { command, class, .. }) => {
                assert_eq!(command, "frobnicate");
                assert_eq!(class, "CommandNotFound");
            }
            other => panic!("unexpected {other:?}"),
        }
        let r = c
            .execute_with_timeout("hang", None, Duration::from_millis(100))
            .await;
        assert!(matches!(r, Err(QmpError::Timeout { .. })), "{r:?}");
        let r = c.execute("bye", None).await;
        assert!(matches!(r, Err(QmpError::Closed)), "{r:?}");
        assert!(c.is_closed());
        assert!(matches!(
            c.execute("query-status", None).await,
            Err(QmpError::Closed)
        ));
    }

    #[tokio::test]
    async fn connect_to_missing_socket_is_typed() {
        let r = QmpClient::connect(Path::new("/nonexistent/q.sock"), Duration::from_secs(1)).await;
        assert!(matches!(r, Err(QmpError::Connect { .. })));
    }
}
