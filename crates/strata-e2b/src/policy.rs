//! Who calls, and whether they may: the caller of a control-plane request
//! ([`Caller`], from `X-API-KEY`), and the tool-call gate shared with
//! stratad's `/v1` routes ([`E2b::gate`]): the same policy layers, the same
//! approval queue and the same hash-chained audit log.

use strata_core::SandboxId;
use strata_policy::{CallKind, ToolCall};
use stratad::security::auth::Role;
use stratad::security::gate::{GateOptions, GateRefusal};
use stratad::store::DEFAULT_TENANT;

use crate::connect::{Code, ConnectError};
use crate::E2b;

/// The caller of a control-plane request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Tenant the caller acts for.
    pub tenant: String,
    /// Role (viewers and approvers may only read).
    pub role: Role,
    /// Actor recorded in approvals and the audit log (`token:tok-…`, or
    /// `e2b-api-key` for a configured key).
    pub actor: String,
}

impl Caller {
    /// A caller with a configured E2B API key (or on an open control
    /// plane): a developer of tenant `default`.
    pub fn api_key() -> Self {
        Caller {
            tenant: DEFAULT_TENANT.to_owned(),
            role: Role::Developer,
            actor: "e2b-api-key".to_owned(),
        }
    }

    /// Whether the caller may change things (create, kill, pause, run…).
    pub fn may_write(&self) -> bool {
        matches!(self.role, Role::Admin | Role::Developer)
    }
}

/// Why the gate refused a tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Denied by a rule (or an approver, or an approval that timed out).
    Denied {
        /// The rule that decided.
        rule: String,
        /// Message for the client (names the rule).
        message: String,
    },
    /// A malformed call (relative path, `..` above `/`, empty argv).
    Invalid(String),
    /// The audit log or the approval queue failed: fail closed.
    Internal(String),
}

impl Refusal {
    /// The message for the client.
    pub fn message(&self) -> &str {
        match self {
            Refusal::Denied { message, .. } => message,
            Refusal::Invalid(m) | Refusal::Internal(m) => m,
        }
    }

    /// As a Connect error (`permission_denied` for a policy refusal).
    pub fn to_connect(&self) -> ConnectError {
        let code = match self {
            Refusal::Denied { .. } => Code::PermissionDenied,
            Refusal::Invalid(_) => Code::InvalidArgument,
            Refusal::Internal(_) => Code::Internal,
        };
        ConnectError::new(code, self.message())
    }

    /// The HTTP status of the control plane and `/files` (403, 400, 500).
    pub fn http_status(&self) -> u16 {
        match self {
            Refusal::Denied { .. } => 403,
            Refusal::Invalid(_) => 400,
            Refusal::Internal(_) => 500,
        }
    }
}

impl E2b {
    /// The tenant and actor of envd calls on sandbox `id`: remembered when
    /// its access token was handed out, else (after a restart) the sandbox
    /// record's tenant and the actor `e2b-envd`.
    pub(crate) async fn envd_caller(
        &self,
        id: &SandboxId,
    ) -> Result<(String, String), ConnectError> {
        if let Some(c) = self
            .envd_callers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
        {
            return Ok(c.clone());
        }
        let rec = self
            .svc
            .get_sandbox(id)
            .await
            .map_err(crate::envd::service_err)?;
        let c = (rec.tenant, "e2b-envd".to_owned());
        self.envd_callers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), c.clone());
        Ok(c)
    }

    /// Remembers who was handed sandbox `id`'s envd access token.
    pub(crate) fn remember_envd_caller(&self, id: &SandboxId, c: &Caller) {
        self.envd_callers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), (c.tenant.clone(), c.actor.clone()));
    }

    /// The gate of an envd call on sandbox `id`, as a Connect error.
    pub(crate) async fn envd_gate(
        &self,
        id: &SandboxId,
        kind: CallKind,
    ) -> Result<(), ConnectError> {
        if self.sec.is_none() {
            return Ok(());
        }
        let (tenant, actor) = self.envd_caller(id).await?;
        self.gate(&tenant, Some(id), &actor, kind)
            .await
            .map_err(|r| r.to_connect())
    }

    /// Decides a tool call through stratad's shared gate (`Security::gate`, also behind `/v1`): evaluate
    /// the layers in force, append the decision to the audit log, and for
    /// `approve` hold the call in the approval queue until an approver
    /// answers or the configured approval timeout passes (then denied).
    /// Without a security subsystem (tests) every call is allowed.
    pub async fn gate(
        &self,
        tenant: &str,
        sandbox: Option<&SandboxId>,
        actor: &str,
        kind: CallKind,
    ) -> Result<(), Refusal> {
        let Some(sec) = self.sec.clone() else {
            return Ok(());
        };
        let call = ToolCall {
            tenant: tenant.to_owned(),
            sandbox: sandbox.map(|s| s.to_string()),
            actor: actor.to_owned(),
            kind,
        };
        sec.gate(call, GateOptions::waiting())
            .await
            .map_err(|r| match r {
                GateRefusal::Invalid(m) => Refusal::Invalid(m),
                GateRefusal::Denied {
                    decision, message, ..
                } => Refusal::Denied {
                    rule: decision.rule_id,
                    message,
                },
                // Only when not waiting, which the E2B API always does.
                GateRefusal::Pending(req) => Refusal::Denied {
                    rule: req.rule_id,
                    message: format!("held for approval {}", req.id),
                },
                GateRefusal::Internal(m) => Refusal::Internal(m),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_connect_and_http() {
        let d = Refusal::Denied {
            rule: "no-rm".into(),
            message: "denied by policy rule `no-rm`: x".into(),
        };
        assert_eq!(d.to_connect().code, Code::PermissionDenied);
        assert!(d.to_connect().message.contains("no-rm"));
        assert_eq!(d.http_status(), 403);
        assert_eq!(Refusal::Invalid("x".into()).http_status(), 400);
        assert_eq!(
            Refusal::Internal("x".into()).to_connect().code,
            Code::Internal
        );
    }

    #[test]
    fn only_admins_and_developers_write() {
        assert!(Caller::api_key().may_write());
        assert_eq!(Caller::api_key().tenant, DEFAULT_TENANT);
        for (role, w) in [
            (Role::Admin, true),
            (Role::Developer, true),
            (Role::Approver, false),
            (Role::Viewer, false),
        ] {
            let c = Caller {
                role,
                ..Caller::api_key()
            };
            assert_eq!(c.may_write(), w, "{role:?}");
        }
    }
}
