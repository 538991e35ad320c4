//! A live terminal over a WebSocket (the web console's sandbox page): the
//! same interactive exec as [`super::interactive`], for browsers, which
//! cannot stream a request body over HTTP/1.1 nor set `Authorization` on a
//! WebSocket.
//!
//! - `POST /v1/sandboxes/{id}/terminal` (bearer, developer or admin; body:
//!   exec's, all optional: `cmd` defaults to `/bin/sh -l`, `tty` to 80×24;
//!   query: the gate's `wait`, `approval_timeout`, `approval`) answers a
//!   random single-use ticket valid [`TICKET_TTL`], bound to this daemon,
//!   the caller (tenant and token), the sandbox, the command and its size.
//! - `GET /v1/sandboxes/{id}/terminal?ticket=…` with an `Origin` equal to the
//!   daemon's own (`http(s)://` + the `Host` it was reached at; anything
//!   else `403` before the ticket is looked at) takes the ticket (`401` if
//!   unknown, used, expired or for another sandbox), then runs the command
//!   through [`crate::service::Service::exec_interactive`] as the ticket's
//!   caller: the one policy gate of every exec, before the upgrade (a
//!   refusal is an HTTP answer, not a socket).
//! - On the socket: client → server text frames `{"stdin": b64}`,
//!   `{"resize": {"cols","rows"}}`, `{"signal": n}` (or binary frames: stdin
//!   bytes); server → client the output as binary frames, then a text frame
//!   `{"exit": code}` (128 + signal when killed) or `{"error": {…}}`, then a
//!   close. The socket closing is a hangup (`SIGHUP`), as in
//!   [`super::interactive`]; a malformed message ends the input the same way.
//!
//! In a cluster the ticket and the socket of another host's sandbox are
//! forwarded to that host (`api::forward`): the ticket is issued by the
//! owner and the upgrade lands there, with the client's `Host` kept, so the
//! `Origin` check compares the browser's origin with the address it
//! reached (a host's, or an API process's).
//!
//! Bounded: a message is at most [`MAX_MESSAGE`] bytes; input goes through
//! the exec's bounded input queue (a command that does not read holds up
//! the socket, not daemon memory); output is read from the command only as
//! fast as the socket takes it (the exec's output window stalls the command).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde_json::json;
use strata_core::{ErrorCode, SandboxId};

use super::interactive::InputLine;
use super::{ApiError, ApiResult, Call, Params, PathId};
use crate::caller::Caller;
use crate::engine::{ExecEvent, ExecInput, ExecInputs, ExecStream, PtySize, Stdin};
use crate::security::gate::GateOptions;
use crate::service::Service;

/// How long a ticket may wait for its socket.
pub const TICKET_TTL: Duration = Duration::from_secs(30);

/// Largest WebSocket message (and frame) the daemon accepts.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// Most tickets outstanding at once (over every caller): more is `429`.
const MAX_TICKETS: usize = 1024;

/// What a terminal runs when the body names no command: a login shell.
/// Plain argv (no `sh -c` string for the policy to read into).
const DEFAULT_SHELL: [&str; 2] = ["/bin/sh", "-l"];

/// One issued ticket.
struct Ticket {
    /// The daemon (service) that issued it.
    svc: usize,
    caller: Caller,
    sandbox: SandboxId,
    req: crate::engine::ExecRequest,
    opts: GateOptions,
    expires: Instant,
}

fn tickets() -> &'static Mutex<HashMap<String, Ticket>> {
    static T: OnceLock<Mutex<HashMap<String, Ticket>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn svc_key(svc: &Arc<Service>) -> usize {
    Arc::as_ptr(svc) as usize
}

/// Stores `t` under a fresh random ticket (`None`: too many outstanding).
fn issue(t: Ticket, now: Instant) -> Option<String> {
    use rand::RngCore;
    let mut raw = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut raw);
    let id = hex::encode(raw);
    let mut map = tickets().lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, t| t.expires > now);
    if map.len() >= MAX_TICKETS {
        return None;
    }
    map.insert(id.clone(), t);
    Some(id)
}

/// Takes (removes) the ticket `id` of daemon `svc` if it has not expired.
fn take(id: &str, svc: usize, now: Instant) -> Option<Ticket> {
    let mut map = tickets().lock().unwrap_or_else(|p| p.into_inner());
    let t = map.remove(id)?;
    (t.svc == svc && t.expires > now).then_some(t)
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg)
}

/// The body of a ticket request (every field optional).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TicketBody {
    /// The command (default: a login shell, bash if present).
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
    /// The terminal's size (default 80×24).
    #[serde(default)]
    tty: Option<PtySize>,
}

/// `POST /v1/sandboxes/{id}/terminal`: a ticket for one terminal.
pub(super) async fn ticket(c: Call, body: Bytes) -> ApiResult<Response> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    // The caller's own sandbox (another tenant's is `404`, as everywhere).
    c.svc.get_sandbox(&c.caller, &id).await?;
    let b: TicketBody = if body.iter().all(u8::is_ascii_whitespace) {
        TicketBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| invalid(format!("invalid JSON body: {e}")))?
    };
    let cmd = b
        .cmd
        .unwrap_or_else(|| DEFAULT_SHELL.map(str::to_owned).to_vec());
    let mut req = crate::engine::ExecRequest::argv(cmd);
    req.env = b.env;
    req.cwd = b.cwd;
    req.stdin = Stdin::Stream;
    req.pty = Some(b.tty.unwrap_or(PtySize { cols: 80, rows: 24 }));
    crate::service::validate_pty(&req)?;
    let now = Instant::now();
    let t = Ticket {
        svc: svc_key(&c.svc),
        caller: c.caller.clone(),
        sandbox: id.clone(),
        req,
        opts,
        expires: now + TICKET_TTL,
    };
    let ticket = issue(t, now).ok_or_else(|| {
        ApiError::new(
            ErrorCode::RateLimited,
            "too many terminal tickets outstanding",
        )
    })?;
    Ok(Json(json!({
        "ticket": ticket,
        "expires_in_s": TICKET_TTL.as_secs(),
        "url": format!("/v1/sandboxes/{id}/terminal?ticket={ticket}"),
    }))
    .into_response())
}

/// Whether `Origin` is exactly the daemon's own origin: `http://` or
/// `https://` followed by the `Host` the request was sent to.
fn same_origin(h: &HeaderMap) -> bool {
    let get = |n: header::HeaderName| h.get(n).and_then(|v| v.to_str().ok());
    let (Some(origin), Some(host)) = (get(header::ORIGIN), get(header::HOST)) else {
        return false;
    };
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    !host.is_empty() && rest.is_some_and(|r| r.eq_ignore_ascii_case(host))
}

/// `GET /v1/sandboxes/{id}/terminal?ticket=…`: the WebSocket.
pub(super) async fn open(State(svc): State<Arc<Service>>, req: Request) -> Response {
    match open_checked(svc, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn open_checked(svc: Arc<Service>, req: Request) -> ApiResult<Response> {
    let (mut parts, _body) = req.into_parts();
    if !same_origin(&parts.headers) {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "a terminal opens only from the daemon's own origin (Origin must equal the Host)",
        ));
    }
    let id: SandboxId = super::parse_id(&PathId::from_request_parts(&mut parts, &()).await?.0)?;
    let q = Params::parse(parts.uri.query(), &["ticket"], &[], false)?;
    let unauthorized = || {
        ApiError::new(
            ErrorCode::Unauthorized,
            "no valid terminal ticket (single use, 30 s, for this sandbox)",
        )
    };
    let t = q
        .one("ticket")
        .and_then(|s| take(s, svc_key(&svc), Instant::now()))
        .ok_or_else(unauthorized)?;
    if t.sandbox != id {
        return Err(unauthorized());
    }
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
        .await
        .map_err(|e| invalid(format!("not a WebSocket upgrade: {}", e.body_text())))?;
    // The one gate of every exec, as the ticket's caller.
    let (events, input) = svc.exec_interactive(&t.caller, &id, t.req, &t.opts).await?;
    Ok(ws
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| pump(socket, events, input, id)))
}

/// How long a command has to end after its terminal went away before it
/// is killed (a shell that ignores `SIGHUP` does not outlive its socket).
const HANGUP_GRACE: Duration = Duration::from_secs(5);

/// Runs one terminal: output to the socket as it is taken, input from it.
async fn pump(socket: WebSocket, mut events: ExecStream, input: ExecInputs, id: SandboxId) {
    let (mut tx, rx) = socket.split();
    let signals = input.clone();
    let mut reader = tokio::spawn(forward(rx, input, id.clone()));
    let mut reading = true;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut end: Option<serde_json::Value> = None;
    let mut gone = false;
    loop {
        let ev = tokio::select! {
            ev = events.next() => ev,
            _ = &mut reader, if reading => {
                // The socket closed (or sent a bad message): a hangup was
                // sent; what outlives the grace period is killed.
                reading = false;
                kill_at = Some(tokio::time::Instant::now() + HANGUP_GRACE);
                continue;
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(tokio::time::Instant::now)), if kill_at.is_some() => {
                kill_at = None;
                tracing::info!(sandbox = %id, "terminal: the command outlived its hangup; killed");
                let _ = tokio::time::timeout(HANGUP_GRACE, signals.send(ExecInput::Signal(libc::SIGKILL))).await;
                continue;
            }
        };
        let msg = match ev {
            None => break,
            Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b))) => Message::Binary(b.to_vec()),
            Some(Ok(ExecEvent::Exit(s))) => {
                let code = s.code.or(s.signal.map(|n| 128 + n)).unwrap_or(-1);
                end = Some(json!({ "exit": code }));
                break;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                end = Some(ApiError::new(e.code(), e.message()).body());
                break;
            }
        };
        // Waits for the socket: the command's output window holds the rest.
        if tx.send(msg).await.is_err() {
            gone = true;
            break;
        }
    }
    reader.abort();
    if end.is_none() && gone {
        // Nobody reads: hang up, and kill what outlives the grace period.
        let _ =
            tokio::time::timeout(HANGUP_GRACE, signals.send(ExecInput::Signal(libc::SIGHUP))).await;
        let ended = tokio::time::timeout(HANGUP_GRACE, async {
            while let Some(ev) = events.next().await {
                if matches!(ev, Ok(ExecEvent::Exit(_)) | Err(_)) {
                    return;
                }
            }
        })
        .await;
        if ended.is_err() {
            tracing::info!(sandbox = %id, "terminal: the command outlived its hangup; killed");
            let _ =
                tokio::time::timeout(HANGUP_GRACE, signals.send(ExecInput::Signal(libc::SIGKILL)))
                    .await;
        }
        return;
    }
    if let Some(v) = end {
        let _ = tx.send(Message::Text(v.to_string())).await;
    }
    let _ = tx.send(Message::Close(None)).await;
}

/// One message of the socket as the command's input (`Ok(None)`: ignored).
fn inputs(m: Message) -> Result<Option<Vec<ExecInput>>, String> {
    match m {
        Message::Binary(b) => Ok(Some(vec![ExecInput::Stdin(Bytes::from(b))])),
        Message::Text(t) => serde_json::from_str::<InputLine>(&t)
            .map_err(|e| e.to_string())
            .and_then(InputLine::inputs)
            .map(Some),
        Message::Ping(_) | Message::Pong(_) => Ok(None),
        Message::Close(_) => Err("closed".into()),
    }
}

/// Feeds the socket's messages to the command until it closes; then hangs up.
async fn forward(
    mut rx: futures::stream::SplitStream<WebSocket>,
    input: ExecInputs,
    id: SandboxId,
) {
    while let Some(m) = rx.next().await {
        let parsed = match m {
            Ok(m) => inputs(m),
            Err(e) => Err(e.to_string()),
        };
        match parsed {
            Ok(Some(v)) => {
                for i in v {
                    if input.send(i).await.is_err() {
                        return; // the command ended
                    }
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(sandbox = %id, error = %e, "terminal: input ended");
                break;
            }
        }
    }
    // The terminal went away.
    let _ = input.send(ExecInput::Signal(libc::SIGHUP)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, host.parse().unwrap());
        if let Some(o) = origin {
            h.insert(header::ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn origin_must_be_the_host_it_was_reached_at() {
        assert!(same_origin(&headers(
            Some("http://127.0.0.1:8080"),
            "127.0.0.1:8080"
        )));
        assert!(same_origin(&headers(
            Some("https://strata.example"),
            "strata.example"
        )));
        for bad in [
            None,
            Some("null"),
            Some("http://evil.example"),
            Some("http://127.0.0.1:8081"),
            Some("http://127.0.0.1:8080.evil.example"),
            Some("ws://127.0.0.1:8080"),
            Some("http://127.0.0.1:8080/"),
        ] {
            assert!(!same_origin(&headers(bad, "127.0.0.1:8080")), "{bad:?}");
        }
    }

    #[test]
    fn a_ticket_is_taken_once_and_expires() {
        let now = Instant::now();
        let t = |svc| Ticket {
            svc,
            caller: Caller::Guest {
                sandbox: "sb-0000000000000000zzzz".parse().unwrap(),
                tenant: "t".into(),
            },
            sandbox: "sb-0000000000000000zzzz".parse().unwrap(),
            req: crate::engine::ExecRequest::argv(["sh"]),
            opts: GateOptions::default(),
            expires: now + TICKET_TTL,
        };
        let a = issue(t(1), now).unwrap();
        assert!(take(&a, 2, now).is_none(), "another daemon's ticket");
        assert!(take(&a, 1, now).is_none(), "a refused attempt consumes it");
        let b = issue(t(1), now).unwrap();
        assert!(take(&b, 1, now + Duration::from_secs(1)).is_some());
        assert!(take(&b, 1, now + Duration::from_secs(1)).is_none(), "used");
        let c = issue(t(1), now).unwrap();
        assert!(take(&c, 1, now + TICKET_TTL).is_none(), "expired");
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }
}
