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

use axum::http::HeaderMap;

use crate::auth::EnvdTarget;
use crate::connect::{Code, ConnectError};
use crate::envd::{ACCESS_TOKEN_HEADER, SANDBOX_ID_HEADER};
pub use crate::error::refusal_code;
use crate::error::{not_running, service_err};
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
    /// `c` (the caller an envd token was handed to) if its credential
    /// still holds: a configured key must still be configured, a strata
    /// token unrevoked and unexpired (checked on every call, no cache: a
    /// revoked token's envd tokens answer 401 at once).
    pub(crate) async fn still_holds(&self, c: Caller) -> Result<Caller, ConnectError> {
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
        let Some(sec) = self.sec.clone() else {
            return Ok(c);
        };
        let c2 = c.clone();
        let holds = tokio::task::spawn_blocking(move || sec.credential_holds(&c2))
            .await
            .map_err(sec_err)?
            .map_err(sec_err)?;
        if !holds {
            return Err(ConnectError::new(
                Code::Unauthenticated,
                "the credential this sandbox's access token was handed to is revoked or expired",
            ));
        }
        Ok(c)
    }

    /// The caller of legacy (HMAC) envd tokens of sandbox `id`: the one
    /// stored by the binding of the release before tokens were stored,
    /// else a developer `e2b-envd` of the sandbox's tenant. An unknown
    /// sandbox answers as not running.
    pub(crate) async fn legacy_envd_caller(&self, id: &SandboxId) -> Result<Caller, ConnectError> {
        if let Some(sec) = self.sec.clone() {
            let sid = id.to_string();
            let bound = tokio::task::spawn_blocking(move || sec.store().envd_binding(&sid))
                .await
                .map_err(sec_err)?
                .map_err(sec_err)?;
            if let Some(c) = bound {
                return self.still_holds(c).await;
            }
        }
        let rec = self
            .svc
            .get_sandbox(&Caller::system(SystemReason::Embedder), id)
            .await
            .map_err(service_err)?;
        Ok(envd_fallback_caller(rec.tenant))
    }

    /// The stored envd tokens of sandbox `raw` and their callers, oldest
    /// first; empty when none was ever issued (a sandbox made before
    /// tokens were stored: its legacy token holds) or without a security
    /// subsystem.
    pub(crate) async fn stored_envd_tokens(
        &self,
        raw: &str,
    ) -> Result<Vec<(String, Caller)>, ConnectError> {
        Ok(self
            .stored_envd_tokens_of(vec![raw.to_owned()])
            .await?
            .pop()
            .unwrap_or_default())
    }

    /// [`E2b::stored_envd_tokens`] of each of `sandboxes` (in one blocking
    /// task: a signed URL may be tried against thousands).
    pub(crate) async fn stored_envd_tokens_of(
        &self,
        sandboxes: Vec<String>,
    ) -> Result<Vec<Vec<(String, Caller)>>, ConnectError> {
        let Some(sec) = self.sec.clone() else {
            return Ok(sandboxes.iter().map(|_| Vec::new()).collect());
        };
        let secret = self.cfg.token_secret.clone();
        tokio::task::spawn_blocking(move || {
            sandboxes
                .iter()
                .map(|sid| {
                    let rows = sec.store().envd_tokens_of(sid)?;
                    Ok(rows
                        .into_iter()
                        .map(|(nonce, c)| (crate::auth::envd_token_of(&secret, sid, &nonce), c))
                        .collect())
                })
                .collect::<Result<Vec<_>, stratad::security::store::SecStoreError>>()
        })
        .await
        .map_err(sec_err)?
        .map_err(sec_err)
    }

    /// Who sandbox `id`'s guest traffic acts as when it is not sent with
    /// an envd token (a traffic token, a public port): the caller of its
    /// first stored envd token (its creator), else the legacy caller.
    pub(crate) async fn sandbox_envd_caller(&self, id: &SandboxId) -> Result<Caller, ConnectError> {
        match self
            .stored_envd_tokens(id.as_str())
            .await?
            .into_iter()
            .next()
        {
            Some((_, c)) => self.still_holds(c).await,
            None => self.legacy_envd_caller(id).await,
        }
    }

    /// Checks envd access token `token` for sandbox `raw` (as sent): a
    /// stored token of that sandbox (looked up by its SHA-256) whose
    /// credential still holds acts as the caller it was issued to; a
    /// sandbox with no stored token takes its legacy HMAC token. Anything
    /// else, a token of another sandbox included, is 401.
    pub(crate) async fn envd_check(
        &self,
        raw: &str,
        token: &str,
    ) -> Result<EnvdTarget, ConnectError> {
        let unauthenticated = || {
            ConnectError::new(
                Code::Unauthenticated,
                "invalid or missing X-Access-Token for this sandbox",
            )
        };
        let parse = |raw: &str| {
            raw.parse::<SandboxId>()
                .map_err(|_| ConnectError::new(Code::Unavailable, not_running(raw)))
        };
        if let Some(sec) = self.sec.clone() {
            let (hash, sid) = (crate::auth::token_hash(token), raw.to_owned());
            let (found, any) = tokio::task::spawn_blocking(move || {
                let s = sec.store();
                Ok::<_, stratad::security::store::SecStoreError>((
                    s.envd_token(&hash)?,
                    !s.envd_tokens_of(&sid)?.is_empty(),
                ))
            })
            .await
            .map_err(sec_err)?
            .map_err(sec_err)?;
            if let Some((_, caller)) = found.filter(|(s, _)| s == raw) {
                let id = parse(raw)?;
                let caller = self.still_holds(caller).await?;
                return Ok(EnvdTarget { id, caller });
            }
            if crate::auth::issued_for(&self.cfg.token_secret, raw, token) {
                // Issued for this sandbox, its row gone with it: answered
                // as E2B answers a killed sandbox's token ("not running",
                // like an unknown id); should the sandbox be there, 401.
                let id = parse(raw)?;
                return match self
                    .svc
                    .get_sandbox(&Caller::system(SystemReason::Embedder), &id)
                    .await
                {
                    Ok(_) => Err(unauthenticated()),
                    Err(e) => Err(service_err(e)),
                };
            }
            if any {
                return Err(unauthenticated());
            }
        }
        if !crate::auth::constant_time_eq(token.as_bytes(), self.envd_token(raw).as_bytes()) {
            return Err(unauthenticated());
        }
        let id = parse(raw)?;
        let caller = self.legacy_envd_caller(&id).await?;
        Ok(EnvdTarget { id, caller })
    }

    /// The sandbox and caller of an envd request (`E2b-Sandbox-Id`,
    /// `X-Access-Token`), see [`E2b::envd_check`].
    pub(crate) async fn envd_target(
        &self,
        headers: &HeaderMap,
    ) -> Result<EnvdTarget, ConnectError> {
        let raw = headers
            .get(SANDBOX_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                ConnectError::new(Code::InvalidArgument, "missing E2b-Sandbox-Id header")
            })?;
        let token = headers
            .get(ACCESS_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        self.envd_check(raw, token).await
    }

    /// Issues sandbox `id`'s envd access token to `caller` (create, fork,
    /// connect, resume, get_info): random, stored (hashed) with the caller
    /// and the credential that obtained it, valid while the sandbox lives
    /// and that credential holds. A credential that already has one for
    /// the sandbox gets the same token again (several clients sharing one
    /// key or token keep working side by side). Without a security
    /// subsystem nothing can be stored: the legacy token.
    pub(crate) async fn issue_envd_token(
        &self,
        id: &SandboxId,
        caller: &Caller,
    ) -> Result<String, String> {
        let Some(sec) = self.sec.clone() else {
            return Ok(self.envd_token(id.as_str()));
        };
        let secret = &self.cfg.token_secret;
        let nonce = crate::auth::envd_nonce();
        let hash =
            crate::auth::token_hash(&crate::auth::envd_token_of(secret, id.as_str(), &nonce));
        let (sid, c) = (id.to_string(), caller.clone());
        let nonce = tokio::task::spawn_blocking(move || {
            sec.store().issue_envd_token(&sid, &c, &nonce, &hash)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        Ok(crate::auth::envd_token_of(secret, id.as_str(), &nonce))
    }

    /// Forgets sandbox `id`'s legacy envd binding (it was deleted; its
    /// stored tokens go with its record).
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

    /// Gates envd tool call `kind` on the sandbox of an envd call for the
    /// caller its token was issued to and returns the grant the guest
    /// operations run under.
    pub(crate) async fn envd_grant(
        &self,
        t: &EnvdTarget,
        kind: CallKind,
    ) -> Result<Grant, ConnectError> {
        self.svc
            .grant(&t.caller, &t.id, kind, &gate_opts())
            .await
            .map_err(service_err)
    }

    /// Access to the sandbox of an envd call for its caller without a tool
    /// call, for the helpers of calls already decided (signals, stdin,
    /// liveness).
    pub(crate) async fn envd_access(&self, t: &EnvdTarget) -> Result<Grant, ConnectError> {
        self.svc.access(&t.caller, &t.id).await.map_err(service_err)
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
