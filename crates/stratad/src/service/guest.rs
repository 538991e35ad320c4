//! Calls into the guest: exec and files, under a [`Grant`] the gate made
//! from the values the action uses.

use super::prelude::*;

/// A tool call the gate allowed on one sandbox of its caller (made only by
/// [`Service::grant`] and [`Service::access`]). Guest file operations run
/// under a grant and only on the paths it covers, so what the gate decided
/// and what runs come from the same values.
#[derive(Debug, Clone)]
pub struct Grant {
    sandbox: SandboxId,
    caller: Caller,
    kind: Option<CallKind>,
    /// The bytes the gate decided with the call (a held upload's), if any.
    body: Option<strata_policy::approval::BodyDigest>,
}

/// A guest file operation, for [`Grant::covers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestOp {
    /// Read a file's content.
    Read,
    /// Stat a path.
    Stat,
    /// List a directory.
    List,
    /// Write a file.
    Write,
    /// Make a directory.
    Mkdir,
    /// Remove a path.
    Remove,
}

pub(crate) fn is_under(path: &str, dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    path.strip_prefix(dir)
        .is_some_and(|rest| rest.starts_with('/'))
}

impl Grant {
    /// The sandbox.
    pub fn sandbox(&self) -> &SandboxId {
        &self.sandbox
    }

    /// Who it was granted to.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// The call the gate decided (`None` for [`Service::access`]).
    pub fn kind(&self) -> Option<&CallKind> {
        self.kind.as_ref()
    }

    /// The digest of the bytes the gate decided with the call (a held
    /// upload, [`Service::grant_held`]): such a grant writes only those
    /// bytes ([`Service::write_held`]).
    pub fn body(&self) -> Option<&strata_policy::approval::BodyDigest> {
        self.body.as_ref()
    }

    /// Whether `op` on `path` is what the gate decided: a read covers
    /// reading, stating and listing the path and what is below it; a write
    /// covers writing, removing and making the path, and stating or making
    /// the directories above it (an upload makes its parent).
    pub fn covers(&self, op: GuestOp, path: &str) -> bool {
        match &self.kind {
            Some(CallKind::FileRead { path: p }) => {
                matches!(op, GuestOp::Read | GuestOp::Stat | GuestOp::List)
                    && (path == p || is_under(path, p))
            }
            Some(CallKind::FileWrite { path: p }) => match op {
                GuestOp::Write | GuestOp::Remove => path == p,
                GuestOp::Mkdir | GuestOp::Stat => path == p || is_under(p, path),
                GuestOp::Read | GuestOp::List => false,
            },
            _ => false,
        }
    }
}

/// Largest PTY side (columns or rows) a caller may ask for.
pub const MAX_PTY_SIDE: u16 = 4096;

/// An interactive command: as [`validate_exec`], a stdin stream allowed, a
/// PTY size within 1..=[`MAX_PTY_SIDE`].
fn validate_interactive(req: &ExecRequest) -> ServiceResult<()> {
    let mut head = req.clone();
    head.stdin = Stdin::Null;
    validate_exec(&head)?;
    validate_pty(req)
}

/// A PTY size, if any, within 1..=[`MAX_PTY_SIDE`] on both sides.
pub fn validate_pty(req: &ExecRequest) -> ServiceResult<()> {
    match req.pty {
        Some(p)
            if !(1..=MAX_PTY_SIDE).contains(&p.cols) || !(1..=MAX_PTY_SIDE).contains(&p.rows) =>
        {
            Err(ServiceError::InvalidRequest(format!(
                "pty: cols and rows must be 1..={MAX_PTY_SIDE} (got {}x{})",
                p.cols, p.rows
            )))
        }
        _ => Ok(()),
    }
}

/// `stream`, each event also recorded in the sandbox's process log.
fn logged(stream: ExecStream, tap: Option<super::LogTap>) -> ExecStream {
    match tap {
        None => stream,
        Some(mut tap) => stream
            .inspect(move |ev| {
                if let Ok(ev) = ev {
                    tap.record(ev);
                }
            })
            .boxed(),
    }
}

impl Service {
    /// With `[security] egress_tls_intercept` on, `req` with
    /// `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE` and `NODE_EXTRA_CA_CERTS`
    /// pointing at the guest's system bundle (where a recipe template
    /// carries the deployment's interception CA: `service::build`) unless
    /// the request sets them: Python `requests` reads certifi's bundle and
    /// Node its own roots otherwise, and would not trust the proxy's leaves
    /// for connector hosts (docs/tls-interception.md). The file is the one
    /// OpenSSL reads by default on Debian, so nothing else changes for a
    /// guest without the CA.
    fn with_tls_env(&self, mut req: ExecRequest) -> ExecRequest {
        if self.config.security.egress_tls_intercept {
            for k in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"] {
                req.env
                    .entry(k.to_owned())
                    .or_insert_with(|| super::build::SYSTEM_CA_BUNDLE.to_owned());
            }
        }
        req
    }

    /// Runs a command; the stream ends with the exit event.
    pub async fn exec(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        req: ExecRequest,
        opts: &GateOptions,
    ) -> ServiceResult<ExecStream> {
        self.get_sandbox(caller, id).await?;
        validate_exec(&req)?;
        validate_pty(&req)?;
        let opts = GateOptions {
            body: exec_body(&req),
            ..opts.clone()
        };
        self.authorize(caller, Some(id), exec_call(&req), &opts)
            .await?;
        let shown = req.command.clone();
        self.exec_granted(id, req, Some((shown, false))).await
    }

    /// Runs a command the caller keeps talking to (stdin stream, PTY
    /// resizes, signals: [`crate::engine::Engine::exec_interactive`]); the
    /// same tool call as [`Service::exec`], gated the same way.
    pub async fn exec_interactive(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        req: ExecRequest,
        opts: &GateOptions,
    ) -> ServiceResult<(ExecStream, crate::engine::ExecInputs)> {
        self.get_sandbox(caller, id).await?;
        validate_interactive(&req)?;
        self.authorize(caller, Some(id), exec_call(&req), opts)
            .await?;
        self.interactive_granted(id, req).await
    }

    /// [`Service::exec_interactive`] for a front door's process under a
    /// grant the gate made for its argv (the E2B door's PTY processes).
    pub async fn exec_helper_interactive(
        self: &Arc<Self>,
        g: &Grant,
        req: ExecRequest,
    ) -> ServiceResult<(ExecStream, crate::engine::ExecInputs)> {
        validate_interactive(&req)?;
        if g.kind.is_none() {
            self.require_running(g).await?;
        }
        self.interactive_granted(&g.sandbox, req).await
    }

    async fn interactive_granted(
        self: &Arc<Self>,
        id: &SandboxId,
        req: ExecRequest,
    ) -> ServiceResult<(ExecStream, crate::engine::ExecInputs)> {
        let rec = self.ensure_awake(id).await?;
        rec.state.apply(Op::Exec)?;
        let tap = self.logs.start(id, &req.command, req.pty.is_some());
        let req = self.with_tls_env(req);
        let (stream, inputs) = self.engine.exec_interactive(id, req).await?;
        Ok((logged(stream, tap), inputs))
    }

    /// Runs `req`; `log_as`: the command its process log shows and whether
    /// it runs in a wrapper that prints a marker line first (`None`: a
    /// helper the log leaves out).
    pub(super) async fn exec_granted(
        self: &Arc<Self>,
        id: &SandboxId,
        req: ExecRequest,
        log_as: Option<(Command, bool)>,
    ) -> ServiceResult<ExecStream> {
        let rec = self.ensure_awake(id).await?;
        rec.state.apply(Op::Exec)?;
        let started = Instant::now();
        let tap = log_as.and_then(|(c, wrapped)| {
            let tap = self.logs.start(id, &c, req.pty.is_some())?;
            Some(if wrapped {
                tap.skip_first_stdout_line()
            } else {
                tap
            })
        });
        let req = self.with_tls_env(req);
        let stream = self.engine.exec(id, req).await?;
        let metrics = self.metrics.clone();
        let stream = stream
            .inspect(move |ev| {
                if let Ok(ExecEvent::Exit(_)) = ev {
                    metrics.observe_step(step::EXEC_ROUND_TRIP, started.elapsed());
                }
            })
            .boxed();
        Ok(logged(stream, tap))
    }

    pub(super) async fn guest_ready(
        self: &Arc<Self>,
        g: &Grant,
        op: GuestOp,
        path: &str,
    ) -> ServiceResult<SandboxId> {
        validate_guest_path(path)?;
        if !g.covers(op, path) {
            // A front door passed a path its grant was not decided for.
            return Err(ServiceError::Forbidden(format!(
                "{op:?} of {path} is not covered by the call the gate decided"
            )));
        }
        let rec = self.ensure_awake(&g.sandbox).await?;
        rec.state.apply(Op::Exec)?;
        Ok(rec.id)
    }

    /// Gates a tool call of `caller` on its sandbox `id` and returns the
    /// grant the guest operations run under ([`Service::read_file`] …).
    /// The call is built by the front door from the values it will use.
    pub async fn grant(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<Grant> {
        self.authorize_on(caller, id, kind.clone(), opts).await?;
        Ok(Grant {
            sandbox: id.clone(),
            caller: caller.clone(),
            kind: Some(kind),
            body: opts.body.clone(),
        })
    }

    /// Access to the caller's sandbox `id` without a tool call: only for a
    /// front door's own helper commands ([`Service::exec_helper`]) that
    /// serve calls already decided (an E2B process's signals and stdin).
    pub async fn access(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<Grant> {
        self.get_sandbox(caller, id).await?;
        Ok(Grant {
            sandbox: id.clone(),
            caller: caller.clone(),
            kind: None,
            body: None,
        })
    }

    /// `Ok` when the grant's sandbox runs now; otherwise the `not running`
    /// error, without waking it (a door's polling of a call decided earlier,
    /// such as an E2B directory watcher, never wakes a hibernated sandbox).
    pub async fn require_running(&self, g: &Grant) -> ServiceResult<()> {
        let rec = self.record(&g.sandbox).await?;
        if rec.state != SandboxState::Running {
            return Err(ServiceError::Engine(RuntimeError::NotRunning {
                id: g.sandbox.to_string(),
            }));
        }
        Ok(())
    }

    /// Runs a front door's helper command under a grant (the E2B door's
    /// process wrapper, `mv` for a move, `kill` for a signal): the gate
    /// already decided the call it serves.
    pub async fn exec_helper(
        self: &Arc<Self>,
        g: &Grant,
        req: ExecRequest,
    ) -> ServiceResult<ExecStream> {
        self.helper_granted(g, req, None).await
    }

    /// [`Service::exec_helper`] for a front door's process that runs the
    /// user's command `shown` inside a wrapper (the E2B door's processes):
    /// the process log shows `shown`, not the wrapper, and leaves out the
    /// wrapper's first stdout line (its marker).
    pub async fn exec_helper_logged(
        self: &Arc<Self>,
        g: &Grant,
        req: ExecRequest,
        shown: Command,
    ) -> ServiceResult<ExecStream> {
        self.helper_granted(g, req, Some((shown, true))).await
    }

    async fn helper_granted(
        self: &Arc<Self>,
        g: &Grant,
        req: ExecRequest,
        log_as: Option<(Command, bool)>,
    ) -> ServiceResult<ExecStream> {
        validate_exec(&req)?;
        if g.kind.is_none() {
            // No tool call was decided: a helper serving one decided earlier
            // (a signal, stdin) never wakes a hibernated sandbox by itself.
            self.require_running(g).await?;
        }
        self.exec_granted(&g.sandbox, req, log_as).await
    }

    /// Streams a guest file.
    pub async fn read_file(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<ByteStream> {
        let id = self.guest_ready(g, GuestOp::Read, path).await?;
        Ok(self.engine.read_file(&id, path).await?)
    }

    /// Writes a guest file from a stream.
    pub async fn write_file(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        if g.body.is_some() {
            // Decided for held bytes: only those may be written.
            return Err(ServiceError::Forbidden(
                "this grant covers the held upload it was decided for only".into(),
            ));
        }
        self.write_granted(g, path, mode, body).await
    }

    /// [`Service::write_file`] once the bytes are known to be the grant's.
    pub(super) async fn write_granted(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        if mode > 0o7777 {
            return Err(ServiceError::InvalidRequest(format!(
                "mode {mode:o}: at most 7777 (octal)"
            )));
        }
        let id = self.guest_ready(g, GuestOp::Write, path).await?;
        Ok(self.engine.write_file(&id, path, mode, body).await?)
    }

    /// Lists a guest directory.
    pub async fn list_dir(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<Vec<DirEntry>> {
        let id = self.guest_ready(g, GuestOp::List, path).await?;
        Ok(self.engine.list_dir(&id, path).await?)
    }

    /// Stats a guest path.
    pub async fn stat(self: &Arc<Self>, g: &Grant, path: &str) -> ServiceResult<DirEntry> {
        let id = self.guest_ready(g, GuestOp::Stat, path).await?;
        Ok(self.engine.stat(&id, path).await?)
    }

    /// Makes a guest directory.
    pub async fn mkdir(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        parents: bool,
    ) -> ServiceResult<()> {
        let id = self.guest_ready(g, GuestOp::Mkdir, path).await?;
        Ok(self.engine.mkdir(&id, path, parents).await?)
    }

    /// Removes a guest path.
    pub async fn remove(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        recursive: bool,
    ) -> ServiceResult<()> {
        if path.trim_end_matches('/').is_empty() {
            return Err(ServiceError::InvalidRequest("refusing to remove /".into()));
        }
        let id = self.guest_ready(g, GuestOp::Remove, path).await?;
        Ok(self.engine.remove(&id, path, recursive).await?)
    }

    /// Replaces a guest path's `user.` attributes named `prefix…` by `set`
    /// (gated as a write of the path).
    pub async fn set_xattrs(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        prefix: &str,
        set: std::collections::BTreeMap<String, String>,
    ) -> ServiceResult<()> {
        let id = self.guest_ready(g, GuestOp::Write, path).await?;
        Ok(self.engine.set_xattrs(&id, path, prefix, set).await?)
    }

    /// The journal of one of the caller's sandboxes.
    pub async fn events(
        &self,
        caller: &Caller,
        id: &SandboxId,
        limit: usize,
    ) -> ServiceResult<Vec<Event>> {
        self.get_sandbox(caller, id).await?;
        let id = id.clone();
        self.db(move |s| s.events(&id, limit.clamp(1, 1000))).await
    }
}
