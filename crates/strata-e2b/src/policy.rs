//! Who calls: the [`Caller`] of a control-plane request (from `X-API-KEY`)
//! and of an envd call (the caller its sandbox's access token was handed
//! to, stored in stratad's security store). The service decides tenancy
//! and gates tool calls (policy, approval, audit) for that caller; this
//! module only builds callers and stores the envd bindings (the gate's
//! refusals become E2B's errors in [`crate::error`]).

use strata_core::SandboxId;
use strata_policy::CallKind;
use stratad::caller::{Caller, SystemReason};
use stratad::security::auth::Role;
use stratad::security::gate::GateOptions;
use stratad::service::Grant;
use stratad::store::DEFAULT_TENANT;

use crate::connect::{Code, ConnectError};
pub use crate::error::refusal_code;
use crate::error::service_err;
use crate::E2b;

/// Actor and token id of a bare configured E2B API key (one without a
/// tenant: `KEY` rather than `KEY=TENANT[:ACTOR]`).
pub const API_KEY_ACTOR: &str = "e2b-api-key";
/// Actor and token id of envd calls whose token has no stored binding (it
/// was handed out before bindings were stored).
pub const ENVD_ACTOR: &str = "e2b-envd";

/// The caller with a bare configured E2B API key (or on an open control
/// plane): a developer of tenant `default`.
pub fn api_key_caller() -> Caller {
    Caller::Api {
        tenant: DEFAULT_TENANT.to_owned(),
        actor: API_KEY_ACTOR.to_owned(),
        role: Role::Developer,
        token: API_KEY_ACTOR.to_owned(),
        name: None,
    }
}

/// The caller of envd calls on a sandbox of `tenant` whose token has no
/// stored binding.
pub fn envd_fallback_caller(tenant: String) -> Caller {
    Caller::Api {
        tenant,
        actor: ENVD_ACTOR.to_owned(),
        role: Role::Developer,
        token: ENVD_ACTOR.to_owned(),
        name: None,
    }
}

/// Whether the caller may change things (create, kill, pause, run…) and be
/// handed envd access tokens: admins and developers.
pub fn may_write(c: &Caller) -> bool {
    matches!(c.role(), Some(Role::Admin | Role::Developer))
}

/// How the door's tool calls wait at the gate: for an approver, up to the
/// configured approval timeout (the SDK has no way to re-send a call with an
/// approval id).
pub fn gate_opts() -> GateOptions {
    GateOptions::waiting()
}

fn sec_err(e: impl std::fmt::Display) -> ConnectError {
    ConnectError::new(Code::Internal, format!("envd token binding: {e}"))
}

impl E2b {
    /// The caller of envd calls on sandbox `id`: the one its access token
    /// was handed to (stored), else a developer `e2b-envd` of the sandbox's
    /// tenant (a token handed out before bindings were stored, or no
    /// security subsystem). An unknown sandbox answers as not running.
    pub(crate) async fn envd_caller(&self, id: &SandboxId) -> Result<Caller, ConnectError> {
        if let Some(sec) = self.sec.clone() {
            let sid = id.to_string();
            let bound = tokio::task::spawn_blocking(move || sec.store().envd_binding(&sid))
                .await
                .map_err(sec_err)?
                .map_err(sec_err)?;
            if let Some(c) = bound {
                // A configured key's binding holds while the key is configured.
                if let Caller::Api { token, .. } = &c {
                    let key_gone = token.starts_with(crate::auth::KEY_ID_PREFIX)
                        && !self.cfg.api_keys.iter().any(|k| k.id() == token);
                    if key_gone {
                        return Err(ConnectError::new(
                            Code::Unauthenticated,
                            "the E2B API key this sandbox's access token was handed to is no longer configured",
                        ));
                    }
                }
                // The binding outlives the request that made it: the
                // credential it names must still hold (not revoked, not
                // expired), as on the control plane.
                let (sec, c2) = (self.sec.clone(), c.clone());
                let holds = match sec {
                    Some(sec) => tokio::task::spawn_blocking(move || sec.credential_holds(&c2))
                        .await
                        .map_err(sec_err)?
                        .map_err(sec_err)?,
                    None => true,
                };
                if !holds {
                    return Err(ConnectError::new(
                        Code::Unauthenticated,
                        "the credential this sandbox's access token was handed to is revoked or expired",
                    ));
                }
                return Ok(c);
            }
        }
        let rec = self
            .svc
            .get_sandbox(&Caller::system(SystemReason::Embedder), id)
            .await
            .map_err(service_err)?;
        Ok(envd_fallback_caller(rec.tenant))
    }

    /// Stores that sandbox `id`'s envd access token was handed to `caller`
    /// (create, connect, get_info): envd calls then act as that caller,
    /// across restarts. Without a security subsystem nothing is stored.
    pub(crate) async fn bind_envd(&self, id: &SandboxId, caller: &Caller) -> Result<(), String> {
        let Some(sec) = self.sec.clone() else {
            return Ok(());
        };
        let (sid, c) = (id.to_string(), caller.clone());
        tokio::task::spawn_blocking(move || sec.store().bind_envd(&sid, &c))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// Forgets sandbox `id`'s envd binding (it was deleted).
    pub(crate) async fn unbind_envd(&self, id: &SandboxId) {
        let Some(sec) = self.sec.clone() else {
            return;
        };
        let sid = id.to_string();
        let r = tokio::task::spawn_blocking(move || sec.store().unbind_envd(&sid)).await;
        if let Err(e) = r
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            tracing::warn!(sandbox = %id, error = %e, "forgetting the envd token binding failed");
        }
    }

    /// Gates envd tool call `kind` on sandbox `id` for its envd caller and
    /// returns the grant the guest operations run under.
    pub(crate) async fn envd_grant(
        &self,
        id: &SandboxId,
        kind: CallKind,
    ) -> Result<Grant, ConnectError> {
        let caller = self.envd_caller(id).await?;
        self.svc
            .grant(&caller, id, kind, &gate_opts())
            .await
            .map_err(service_err)
    }

    /// Access to sandbox `id` for its envd caller without a tool call, for
    /// the helpers of calls already decided (signals, stdin, liveness).
    pub(crate) async fn envd_access(&self, id: &SandboxId) -> Result<Grant, ConnectError> {
        let caller = self.envd_caller(id).await?;
        self.svc.access(&caller, id).await.map_err(service_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_admins_and_developers_write() {
        let k = api_key_caller();
        assert!(may_write(&k));
        assert_eq!(k.tenant(), Some(DEFAULT_TENANT));
        assert_eq!(k.actor(), API_KEY_ACTOR);
        for (role, w) in [
            (Role::Admin, true),
            (Role::Developer, true),
            (Role::Approver, false),
            (Role::Viewer, false),
            (Role::Metrics, false),
        ] {
            let c = Caller::api(DEFAULT_TENANT, role, "tok-1");
            assert_eq!(may_write(&c), w, "{role:?}");
        }
        assert!(!may_write(&Caller::system(SystemReason::Embedder)));
        let f = envd_fallback_caller("acme".into());
        assert_eq!((f.tenant(), f.actor()), (Some("acme"), ENVD_ACTOR.into()));
    }
}
