//! Lookups by caller and the tool-call gate: the one place tenant visibility
//! is decided. Another tenant's id answers exactly like an unknown id.

use super::prelude::*;

impl Service {
    /// A sandbox record that is not deleted, whoever owns it (the
    /// service's own bookkeeping; commands look up through
    /// [`Service::get_sandbox`]).
    pub(super) async fn record(&self, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_sandbox(&id2)).await? {
            Some(r) if r.state != SandboxState::Deleted => Ok(r),
            _ => Err(not_found("sandbox", id)),
        }
    }

    /// A sandbox record the caller may see: another tenant's sandbox
    /// answers exactly like an unknown id.
    pub async fn get_sandbox(
        &self,
        caller: &Caller,
        id: &SandboxId,
    ) -> ServiceResult<SandboxRecord> {
        match self.record(id).await {
            Ok(r) if caller.sees(&r.tenant) => Ok(r),
            Ok(_) => Err(not_found("sandbox", id)),
            Err(e) => Err(e),
        }
    }

    /// A filtered page of the caller's sandboxes (the filter's tenant is
    /// the caller's; only the daemon lists another tenant's).
    pub async fn list_sandboxes(
        &self,
        caller: &Caller,
        mut f: SandboxFilter,
    ) -> ServiceResult<Page<SandboxRecord>> {
        if let Some(t) = caller.tenant() {
            f.tenant = t.to_owned();
        }
        self.db(move |s| s.list_sandboxes(&f)).await
    }

    /// A snapshot record that is not deleted, whoever owns it.
    pub(super) async fn snapshot_record(&self, id: &SnapshotId) -> ServiceResult<SnapshotRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_snapshot(&id2)).await? {
            Some(r) if r.status != SnapshotStatus::Deleted => Ok(r),
            _ => Err(not_found("snapshot", id)),
        }
    }

    /// A template record that is not deleted, whoever owns it.
    pub(super) async fn template_record(&self, id: &TemplateId) -> ServiceResult<TemplateRecord> {
        let id2 = id.clone();
        match self.db(move |s| s.get_template(&id2)).await? {
            Some(r) if r.status != TemplateStatus::Deleted => Ok(r),
            _ => Err(not_found("template", id)),
        }
    }

    /// Decides a tool call of `caller` through the gate (policy, approval,
    /// audit), with the values the action will use. The daemon's own work
    /// ([`Caller::System`]) is not a tool call: it is not gated.
    pub async fn authorize(
        &self,
        caller: &Caller,
        sandbox: Option<&SandboxId>,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<()> {
        let Some(tenant) = caller.tenant() else {
            return Ok(());
        };
        let call = ToolCall {
            tenant: tenant.to_owned(),
            sandbox: sandbox.map(|s| s.to_string()),
            actor: caller.actor(),
            kind,
        };
        self.gate
            .check(call, opts.clone())
            .await
            .map_err(ServiceError::Gate)
    }

    /// Looks up the caller's sandbox `id`, then gates `kind` on it.
    pub(super) async fn authorize_on(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: CallKind,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let rec = self.get_sandbox(caller, id).await?;
        self.authorize(caller, Some(id), kind, opts).await?;
        Ok(rec)
    }
}
