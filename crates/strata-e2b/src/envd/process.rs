//! `process.Process/*`: start a command (server stream of its events with
//! keepalives), reconnect to it, list, send input and signals, close stdin.
//! The processes themselves are [`crate::procs`]'s handles over strata's
//! one-shot exec; a PTY process (`pty` in `Start`) is an interactive exec on
//! a pseudo-terminal, its input is `SendInput` with `pty` bytes, its window
//! size `Update`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde_json::json;
use strata_core::SandboxId;
use strata_policy::{CallKind, ExecStdin};
use stratad::engine::ExecInput;
use stratad::service::Grant;
use tokio::sync::mpsc;

use super::{CappedBody, KEEPALIVE_HEADER};
use crate::auth::{EnvdSandbox, EnvdTarget};
use crate::connect::{self, Code, ConnectError};
use crate::error::service_err;
use crate::procs::{self, Proc};
use crate::proto::{self, ProcessEvent};
use crate::E2b;

fn keepalive_interval(headers: &HeaderMap) -> Duration {
    let s = headers
        .get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(30)
        .clamp(1, 3600);
    Duration::from_secs(s)
}

/// Why a process stream ended without an `end`: the sandbox was deleted
/// (killed, or its timeout ended it), or it was paused.
async fn ended_because(st: &E2b, t: &EnvdTarget) -> &'static str {
    // Gone, or being deleted (the VM ends before the record does).
    let gone = match st.svc.get_sandbox(&t.caller, &t.id).await {
        Ok(rec) => rec.pending_op == Some(strata_core::Op::Delete),
        Err(_) => true,
    };
    if gone {
        "the process's output stream ended: the sandbox was killed or reached its end of life"
    } else {
        "the process's output stream ended (the sandbox was paused); reconnect with commands.connect"
    }
}

/// The frames of a process stream: `start`, then the events with keepalives,
/// then the trailer. A channel that closes without an `end` (the sandbox
/// was paused or killed) ends with a `canceled` error saying which.
fn event_frames(
    st: Arc<E2b>,
    id: EnvdTarget,
    pid: u32,
    rx: mpsc::Receiver<ProcessEvent>,
    keepalive: Duration,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let first = connect::message_frame(&ProcessEvent::Start { pid }.to_response_json());
    let tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    let rest = futures::stream::unfold(Some((rx, tick)), move |state| {
        let (st, id) = (st.clone(), id.clone());
        async move {
            let (mut rx, mut tick) = state?;
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev @ ProcessEvent::End { .. }) => {
                        let mut b = connect::message_frame(&ev.to_response_json()).to_vec();
                        b.extend_from_slice(&connect::end_ok_frame());
                        Some((Bytes::from(b), None))
                    }
                    Some(ev) => Some((connect::message_frame(&ev.to_response_json()), Some((rx, tick)))),
                    None => Some((
                        ConnectError::new(Code::Canceled, ended_because(&st, &id).await).end_frame(),
                        None,
                    )),
                },
                _ = tick.tick() => Some((
                    connect::message_frame(&ProcessEvent::KeepAlive.to_response_json()),
                    Some((rx, tick)),
                )),
            }
        }
    });
    futures::stream::iter([first]).chain(rest)
}

/// A stream for a process whose output is detached: `start`, keepalives
/// while `/proc/<pid>` exists, then an `end` of unknown status.
fn detached_frames(
    st: Arc<E2b>,
    g: Grant,
    pid: u32,
    keepalive: Duration,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let first = connect::message_frame(&ProcessEvent::Start { pid }.to_response_json());
    let rest = futures::stream::unfold(Some(tokio::time::Instant::now()), move |state| {
        let (st, g) = (st.clone(), g.clone());
        async move {
            let mut last = state?;
            loop {
                tokio::time::sleep(procs::DETACHED_POLL).await;
                match procs::alive(&st.svc, &g, &[pid]).await {
                    Ok(v) if v.contains(&pid) => {
                        if last.elapsed() >= keepalive {
                            last = tokio::time::Instant::now();
                            return Some((
                                connect::message_frame(&ProcessEvent::KeepAlive.to_response_json()),
                                Some(last),
                            ));
                        }
                    }
                    Ok(_) => {
                        st.procs.remove(g.sandbox(), pid);
                        let end = ProcessEvent::End {
                            exit_code: -1,
                            exited: false,
                            status: "unknown".into(),
                            error: Some(
                                "the process ended while its output was detached (the sandbox was paused); its exit status is unknown"
                                    .into(),
                            ),
                        };
                        let mut b = connect::message_frame(&end.to_response_json()).to_vec();
                        b.extend_from_slice(&connect::end_ok_frame());
                        return Some((Bytes::from(b), None));
                    }
                    Err(e) => return Some((e.end_frame(), None)),
                }
            }
        }
    });
    futures::stream::iter([first]).chain(rest)
}

/// `process.Process/Start` (server stream).
pub async fn start(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Extension(EnvdSandbox(id)): Extension<EnvdSandbox>,
    CappedBody(body): CappedBody,
) -> Response {
    let run = async {
        let req: proto::StartRequest = connect::stream_request(&body)?;
        let pty = match &req.pty {
            Some(p) => Some(procs::pty_size(Some(p))?),
            None => None,
        };
        if req.process.cmd.is_empty() {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process.cmd is empty",
            ));
        }
        // The policy sees the argv the SDK sends (`/bin/bash -l -c CMD`);
        // its shell reading splits CMD into simple commands.
        let argv: Vec<String> = std::iter::once(req.process.cmd.clone())
            .chain(req.process.args.iter().cloned())
            .collect();
        let mut env: BTreeMap<String, String> = st.sandbox_envs(&id);
        env.extend(req.process.envs.clone());
        // Commands run as the requested user (default `user`), in its home
        // unless a cwd is given (envd's rule).
        let user = super::envd_user(&headers, None)?;
        let mut config = req.process;
        config.cwd = match config.cwd.take() {
            Some(c) => Some(st.user_path(&user, &c)),
            None => super::user_home(&user).map(|h| {
                if super::is_root(&user) {
                    st.guest_path("")
                } else {
                    h
                }
            }),
        };
        // What the wrapper runs with besides the argv: checked as the
        // service's exec checks it (the wrapper runs as a helper).
        if let Some(cwd) = &config.cwd {
            stratad::service::validate_guest_path(cwd).map_err(service_err)?;
        }
        if env
            .iter()
            .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "envs: NUL bytes are not allowed",
            ));
        }
        // The policy sees the whole environment (the sandbox's `envVars`
        // too), the cwd and whether stdin is open (a terminal's is).
        let stdin = if pty.is_some() || req.stdin.unwrap_or(false) {
            ExecStdin::Stream
        } else {
            ExecStdin::None
        };
        let call = CallKind::exec(argv).with_context(&env, config.cwd.clone(), stdin);
        let g = st.envd_grant(&id, call).await?;
        let reg = st.procs.clone();
        if let Some(size) = pty {
            return procs::start_pty(&st.svc, &reg, &g, config, env, req.tag, size, Some(user))
                .await;
        }
        procs::start(
            &st.svc,
            &reg,
            &g,
            config,
            env,
            req.tag,
            req.stdin.unwrap_or(false),
            Some(user),
        )
        .await
    };
    match run.await {
        Ok((proc, rx)) => connect::stream_response(connect::until_deadline(
            event_frames(
                st.clone(),
                id.clone(),
                proc.pid,
                rx,
                keepalive_interval(&headers),
            ),
            connect::connect_timeout(&headers),
        )),
        Err(e) => connect::stream_error(e),
    }
}

fn select(
    st: &E2b,
    id: &SandboxId,
    sel: &proto::ProcessSelector,
) -> Result<Option<Arc<Proc>>, ConnectError> {
    if sel.pid.is_none() && sel.tag.is_none() {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            "process selector needs a pid or a tag",
        ));
    }
    Ok(st.procs.find(id, sel.pid, sel.tag.as_deref()))
}

/// `process.Process/Connect` (server stream): attach to a running process.
pub async fn connect(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Extension(EnvdSandbox(id)): Extension<EnvdSandbox>,
    CappedBody(body): CappedBody,
) -> Response {
    let keepalive = keepalive_interval(&headers);
    let deadline = connect::connect_timeout(&headers);
    let run = async {
        let req: proto::SelectRequest = connect::stream_request(&body)?;
        // The sandbox first: a gone one answers `not running` before any
        // table of the door is consulted.
        let g = st.envd_access(&id).await?;
        let found = select(&st, &id, &req.process)?;
        if let Some(p) = &found {
            if let Some(rx) = p.subscribe() {
                return Ok(connect::stream_response(connect::until_deadline(
                    event_frames(st.clone(), id.clone(), p.pid, rx, keepalive),
                    deadline,
                )));
            }
        }
        let pid = found
            .as_ref()
            .map(|p| p.pid)
            .or(req.process.pid)
            .ok_or_else(|| ConnectError::new(Code::NotFound, "no process with that tag"))?;
        if found.is_none() {
            return Err(ConnectError::new(
                Code::NotFound,
                format!("process with pid {pid} not found"),
            ));
        }
        if procs::alive(&st.svc, &g, &[pid]).await?.is_empty() {
            st.procs.remove(&id, pid);
            return Err(ConnectError::new(
                Code::NotFound,
                format!("process with pid {pid} not found"),
            ));
        }
        Ok(connect::stream_response(connect::until_deadline(
            detached_frames(st.clone(), g, pid, keepalive),
            deadline,
        )))
    };
    match run.await {
        Ok(r) => r,
        Err(e) => connect::stream_error(e),
    }
}

/// `process.Process/List`: the processes started through envd that still run.
pub async fn list(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, serde_json::Value, |id, _r| async {
        let g = st.envd_access(&id).await?;
        let all = st.procs.all(&id);
        let detached: Vec<u32> = all
            .iter()
            .filter(|p| !p.attached())
            .map(|p| p.pid)
            .collect();
        let live = if detached.is_empty() {
            Vec::new()
        } else {
            procs::alive(&st.svc, &g, &detached).await?
        };
        let mut out = Vec::new();
        for p in all {
            if p.attached() || live.contains(&p.pid) {
                out.push(p.info());
            } else {
                st.procs.remove(&id, p.pid);
            }
        }
        out.sort_by_key(|p| p.pid);
        Ok::<_, ConnectError>(json!({ "processes": out }))
    })
}

fn require(found: Option<Arc<Proc>>) -> Result<Arc<Proc>, ConnectError> {
    found.ok_or_else(|| ConnectError::new(Code::NotFound, "process not found"))
}

/// `process.Process/SendInput`.
pub async fn send_input(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::SendInputRequest, |id, r| async {
        let g = st.envd_access(&id).await?;
        let p = require(select(&st, &id, &r.process)?)?;
        if p.pty.is_some() || r.input.pty.is_some() {
            // envd: `pty` bytes go to a PTY process's terminal only.
            let Some(data) = r.input.pty else {
                return Err(ConnectError::new(
                    Code::FailedPrecondition,
                    format!("process {} is a PTY: send its input as pty", p.pid),
                ));
            };
            if !data.is_empty() {
                p.pty_input(ExecInput::Stdin(Bytes::from(data))).await?;
            }
            return Ok(json!({}));
        }
        if !p.stdin {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} was started without stdin", p.pid),
            ));
        }
        let data = r.input.stdin.unwrap_or_default();
        if !data.is_empty() {
            procs::send_input(&st.svc, &g, p.pid, data).await?;
        }
        Ok::<_, ConnectError>(json!({}))
    })
}

/// `process.Process/Update`: a PTY process's new window size.
pub async fn update(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::UpdateRequest, |id, r| async {
        let _g = st.envd_access(&id).await?;
        let p = require(select(&st, &id, &r.process)?)?;
        if let Some(pty) = &r.pty {
            let size = procs::pty_size(Some(pty))?;
            p.pty_input(ExecInput::Resize(size)).await?;
        }
        Ok::<_, ConnectError>(json!({}))
    })
}

/// `process.Process/SendSignal` (to the process group).
pub async fn send_signal(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::SendSignalRequest, |id, r| async {
        let g = st.envd_access(&id).await?;
        let p = require(select(&st, &id, &r.process)?)?;
        let sig = r
            .signal_number()
            .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "unsupported signal"))?;
        procs::signal(&st.svc, &g, p.pid, sig).await?;
        Ok::<_, ConnectError>(json!({}))
    })
}

/// `process.Process/CloseStdin`.
pub async fn close_stdin(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::SelectRequest, |id, r| async {
        let g = st.envd_access(&id).await?;
        let p = require(select(&st, &id, &r.process)?)?;
        if !p.stdin {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} was started without stdin", p.pid),
            ));
        }
        procs::close_stdin(&st.svc, &g, p.pid).await?;
        Ok::<_, ConnectError>(json!({}))
    })
}
