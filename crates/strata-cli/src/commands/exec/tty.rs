//! `strata exec -t`: an interactive command on a pseudo-terminal.
//!
//! One request carries the session both ways (docs/pty.md): its body is
//! NDJSON — the exec body with `tty {cols, rows}` (this terminal's size),
//! then `{"stdin": b64}` per chunk typed and `{"resize": …}` per `SIGWINCH`
//! — and stays open until the command ends; the answer is exec's NDJSON
//! stream. This terminal is in raw mode meanwhile (restored on every way
//! out: exit, error, panic), so `^C`, `^D` and line editing are the remote
//! terminal's.

use std::io::{IsTerminal as _, Read as _, Write as _};

use base64::Engine as _;
use bytes::Bytes;
use reqwest::Method;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{body, exit_status, pump_lines, write_flush, Args, Line};
use crate::api::ApiError;
use crate::commands::{CliError, Ctx};

/// Input lines queued for the request body.
const QUEUE: usize = 64;

/// The size of the terminal on fd 0: `(cols, rows)`.
fn window_size() -> Option<(u16, u16)> {
    // SAFETY: `winsize` is plain data; TIOCGWINSZ fills it or fails.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one `winsize` to the valid pointer.
    let r = unsafe { libc::ioctl(0, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some((ws.ws_col, ws.ws_row))
}

/// The terminal on fd 0 in raw mode until dropped.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enable() -> std::io::Result<Self> {
        // SAFETY: `termios` is plain data; tcgetattr fills it or fails.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: tcgetattr/cfmakeraw/tcsetattr on fd 0 with valid pointers.
        unsafe {
            if libc::tcgetattr(0, &mut t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let saved = t;
            libc::cfmakeraw(&mut t);
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(Self { saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the attributes read in `enable` on fd 0.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.saved) };
    }
}

fn ndjson(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

/// Reads what is typed (a thread: a blocked read must not hold up the
/// runtime's shutdown) and queues it as input lines.
fn pump_stdin(tx: mpsc::Sender<Bytes>) {
    std::thread::spawn(move || {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        loop {
            let line = match stdin.read(&mut buf) {
                Ok(n) if n > 0 => json!({ "stdin": b64.encode(&buf[..n]) }),
                _ => json!({ "close_stdin": true }),
            };
            let last = line.get("close_stdin").is_some();
            if tx.blocking_send(ndjson(&line)).is_err() || last {
                return;
            }
        }
    });
}

/// Queues a resize line at every `SIGWINCH`.
fn pump_winch(tx: mpsc::Sender<Bytes>) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut winch = signal(SignalKind::window_change())?;
    tokio::spawn(async move {
        while winch.recv().await.is_some() {
            if let Some((cols, rows)) = window_size() {
                let line = json!({ "resize": { "cols": cols, "rows": rows } });
                if tx.send(ndjson(&line)).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(())
}

/// Runs `strata exec -t`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    if ctx.json {
        return Err(CliError::InvalidArgument("-t does not go with --json".into()).into());
    }
    if !std::io::stdin().is_terminal() {
        return Err(CliError::InvalidArgument("-t needs a terminal on stdin".into()).into());
    }
    let (cols, rows) = window_size().unwrap_or((80, 24));
    let mut first = body(&a, None)?;
    first["tty"] = json!({ "cols": cols, "rows": rows });
    let client = ctx.client()?;
    let url = client.url(&["v1", "sandboxes", &a.id, "exec"], &[]);
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUE);
    tx.send(ndjson(&first)).await?;
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
    });
    let rb = client
        .request(Method::POST, url)
        .header(reqwest::header::CONTENT_TYPE, "application/x-ndjson")
        .body(reqwest::Body::wrap_stream(stream));

    let raw = RawMode::enable()
        .map_err(|e| anyhow::anyhow!("cannot put the terminal in raw mode: {e}"))?;
    pump_stdin(tx.clone());
    pump_winch(tx.clone())?;
    // The stdin thread and the SIGWINCH task keep the body open.
    drop(tx);

    let resp = client.send(rb).await?;
    let mut exit: Option<(Option<i32>, Option<i32>)> = None;
    pump_lines(&client, resp, |line| {
        match line {
            Line::Stdout(d) => write_flush(&mut std::io::stdout().lock(), &d),
            Line::Stderr(d) => write_flush(&mut std::io::stderr().lock(), &d),
            Line::Exit { code, signal } => exit = Some((code, signal)),
        }
        Ok(())
    })
    .await?;
    drop(raw);
    let _ = std::io::stdout().flush();
    let Some((code, signal)) = exit else {
        return Err(ApiError::Protocol {
            url: client.base().to_string(),
            reason: "the exec stream ended without an exit status".into(),
        }
        .into());
    };
    Ok(exit_status(code, signal))
}
