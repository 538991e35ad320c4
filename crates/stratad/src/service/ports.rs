//! Connections from outside to a sandbox's TCP ports, over its agent
//! channel: [`Service::open_port`].
//!
//! Order of checks: the caller sees the sandbox (another tenant's id answers
//! like an unknown one), the port is valid, the tool-call gate decides
//! `port {port}` (a refusal is audited at once), the sandbox is woken (a
//! hibernated or paused one, when its lifecycle allows auto-resume), then
//! the engine opens the tunnel (a refused guest port is retried for up to
//! `port_connect_grace`, 3 s by default, or [`WAKE_CONNECT_GRACE`] for a
//! connection that woke the sandbox: its server may still be starting). An allowed connection is audited once, when
//! it ends, with the bytes it carried each way (a connection the guest
//! refused: with zero bytes). Traffic counts as activity of the sandbox.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use strata_policy::{Decision, PortBytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::prelude::*;
use crate::engine::{PortCounters, PortError, PortOpenError, PortStream};

/// How often a busy connection refreshes its sandbox's activity.
const TOUCH_EVERY: Duration = Duration::from_secs(1);

/// How long a connection that woke its sandbox retries a guest port that
/// refuses it (the woken guest's server may not listen yet), with backoff
/// from 100 ms to 1 s; past it (or without a wake) a refusal is final.
pub const WAKE_CONNECT_GRACE: Duration = Duration::from_secs(10);

/// An open connection to a guest port ([`Service::open_port`]). Its audit
/// entry is written when it is dropped.
pub struct PortConn {
    stream: PortStream,
    svc: Arc<Service>,
    sandbox: SandboxId,
    last_touch: Instant,
    /// Every read and write, unthrottled: a guest that got bytes is not
    /// an unchanged one (`service::unchanged`).
    note: super::ActivityNote,
    audit: Option<(ToolCall, Decision)>,
}

impl std::fmt::Debug for PortConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortConn")
            .field("sandbox", &self.sandbox)
            .field("port", &self.stream.port())
            .finish()
    }
}

impl PortConn {
    /// The guest port.
    pub fn port(&self) -> u16 {
        self.stream.port()
    }

    /// The live byte counts.
    pub fn counters(&self) -> Arc<PortCounters> {
        self.stream.counters()
    }

    fn activity(&mut self) {
        self.note.note();
        if self.last_touch.elapsed() >= TOUCH_EVERY {
            self.last_touch = Instant::now();
            self.svc.touch(&self.sandbox);
        }
    }
}

fn audit_closed(gate: Arc<dyn ToolGate>, mut call: ToolCall, d: Decision, bytes: PortBytes) {
    if let CallKind::Port { bytes: b, .. } = &mut call.kind {
        *b = Some(bytes);
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        warn!(sandbox = ?call.sandbox, "no runtime to audit a closed port connection");
        return;
    };
    rt.spawn(async move {
        if let Err(e) = gate.close(call, d).await {
            warn!(error = %e, "auditing a closed port connection failed");
        }
    });
}

impl Drop for PortConn {
    fn drop(&mut self) {
        // Outside a runtime (its shutdown) there is nothing to record to.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.svc.touch(&self.sandbox);
        }
        if let Some((call, d)) = self.audit.take() {
            let c = self.stream.counters();
            let bytes = PortBytes {
                to_guest: c.to_guest.load(Ordering::Relaxed),
                from_guest: c.from_guest.load(Ordering::Relaxed),
            };
            audit_closed(self.svc.gate.clone(), call, d, bytes);
        }
    }
}

impl AsyncRead for PortConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if r.is_ready() {
            self.activity();
        }
        r
    }
}

impl AsyncWrite for PortConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        if r.is_ready() {
            self.activity();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A port tunnel failure of sandbox `id` as a service error: nothing
/// listening is the guest's `not_found`, an old agent `invalid_state`, the
/// cap `quota_exceeded`.
fn port_err(id: &SandboxId, e: PortOpenError) -> ServiceError {
    let sid = id.to_string();
    match e {
        PortOpenError::Runtime(e) => ServiceError::Engine(e),
        PortOpenError::Port(p) => match p {
            PortError::Refused { .. } => ServiceError::Engine(RuntimeError::Guest {
                id: sid,
                kind: crate::engine::GuestErrorKind::NotFound,
                message: p.to_string(),
            }),
            PortError::Unsupported => ServiceError::InvalidStateOther(format!(
                "sandbox {id}: {p}; create it from a newer template to reach its ports"
            )),
            PortError::InvalidPort(_) => ServiceError::InvalidRequest(p.to_string()),
            PortError::TooMany { .. } => ServiceError::QuotaExceeded(p.to_string()),
            PortError::Timeout { .. } => ServiceError::Engine(RuntimeError::AgentTimeout {
                id: sid,
                timeout_ms: strata_proto::client::PORT_CONNECT_TIMEOUT.as_millis() as u64,
            }),
            PortError::Guest { kind, message, .. } => ServiceError::Engine(
                RuntimeError::from_agent(&sid, strata_proto::AgentError::Remote { kind, message }),
            ),
            PortError::Agent(e) => ServiceError::Engine(RuntimeError::from_agent(&sid, e)),
        },
    }
}

/// Whether `e` says nothing accepts connections on the guest port.
pub fn is_port_closed(e: &ServiceError) -> bool {
    matches!(
        e,
        ServiceError::Engine(RuntimeError::Guest {
            kind: crate::engine::GuestErrorKind::NotFound,
            ..
        })
    )
}

impl Service {
    /// Opens a connection to `127.0.0.1:<port>` inside `caller`'s sandbox
    /// `id` (see the module docs for the checks, the wake and the audit).
    pub async fn open_port(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        port: u16,
        opts: &GateOptions,
    ) -> ServiceResult<PortConn> {
        self.get_sandbox(caller, id).await?;
        if port == 0 {
            return Err(ServiceError::InvalidRequest("port 0 is not a port".into()));
        }
        let call = caller.tenant().map(|tenant| ToolCall {
            tenant: tenant.to_owned(),
            sandbox: Some(id.to_string()),
            actor: caller.actor(),
            kind: CallKind::Port { port, bytes: None },
        });
        let decision = match &call {
            Some(c) => self
                .gate
                .open(c.clone(), opts.clone())
                .await
                .map_err(ServiceError::Gate)?,
            None => None,
        };
        let audit = call.zip(decision);
        let opened = self.port_stream(id, port).await;
        match opened {
            Ok(stream) => Ok(PortConn {
                stream,
                svc: self.clone(),
                sandbox: id.clone(),
                last_touch: Instant::now(),
                note: self.activity_note(id),
                audit,
            }),
            Err(e) => {
                if let Some((call, d)) = audit {
                    let none = PortBytes {
                        to_guest: 0,
                        from_guest: 0,
                    };
                    audit_closed(self.gate.clone(), call, d, none);
                }
                Err(e)
            }
        }
    }

    async fn port_stream(self: &Arc<Self>, id: &SandboxId, port: u16) -> ServiceResult<PortStream> {
        // A background operation under way (its timeout's hibernate) is
        // waited for (≤ 30 s), so the state read next is the one it left:
        // traffic arriving mid-hibernate wakes the sandbox instead of
        // meeting a VM that is going away. A user's operation is not waited
        // for (the connection goes on as before).
        drop(self.acquire(id, Op::Exec, Who::User).await);
        let before = self.record(id).await?.state;
        let mut rec = self.ensure_awake(id).await?;
        if rec.state == SandboxState::Paused && self.may_auto_resume(id).await? {
            rec = self.resume_ungated(id).await?;
        }
        rec.state.apply(Op::Exec)?;
        self.touch(id);
        // This request woke the sandbox: a server in the guest may still be
        // starting (it was stopped mid-start), so a refused connect is tried
        // again for a short while before it counts as nothing listening.
        // A running one gets `port_connect_grace`: a client often asks
        // right after starting its server in the background.
        let woke = before != SandboxState::Running && rec.state == SandboxState::Running;
        let (grace, mut wait, max_wait) = if woke {
            (
                WAKE_CONNECT_GRACE.max(self.config.port_connect_grace),
                Duration::from_millis(100),
                Duration::from_secs(1),
            )
        } else {
            (
                self.config.port_connect_grace,
                Duration::from_millis(50),
                Duration::from_millis(500),
            )
        };
        let deadline = Instant::now() + grace;
        loop {
            match self.engine.connect_port(id, port).await {
                Err(PortOpenError::Port(PortError::Refused { .. }))
                    if Instant::now() + wait < deadline =>
                {
                    tokio::time::sleep(wait).await;
                    // Waiting is activity: a short idle timeout must not
                    // put the sandbox back to sleep under the retries.
                    self.touch(id);
                    wait = (wait * 2).min(max_wait);
                }
                r => return r.map_err(|e| port_err(id, e)),
            }
        }
    }
}
