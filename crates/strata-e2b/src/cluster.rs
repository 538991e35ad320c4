//! The door on a cluster (docs/cluster.md, "The E2B door on a cluster"):
//! every door request that names a sandbox another host holds goes to that
//! host's door, through stratad's forwarding ([`stratad::api::forward::door`]:
//! the loop rule, `owner_unreachable`, streaming both ways, `x-strata-host`).
//! This module only says what a request is about and how its refusals look:
//!
//! - control plane ([`control`], inside the `X-API-KEY` check): the `:id`
//!   of `/sandboxes/:id/…` and `/v2/sandboxes/:id/…`; `POST /sandboxes`
//!   and `POST /v2/sandboxes` are creates (placed, re-sent to the chosen
//!   host); the template build routes need a host; lists, `/snapshots`,
//!   template tags and aliases are answered here (from the store);
//! - envd ([`envd`], inside the access-token or signed-URL check): the
//!   sandbox the check found (`E2b-Sandbox-Id`, or the signed URL's);
//! - guest ports (`crate::ports`, after its credential check): the sandbox
//!   of the `Host` or `E2b-Sandbox-Id`, re-sent with `E2b-Sandbox-Id` and
//!   `E2b-Sandbox-Port` (the owner's `domain` may differ).
//!
//! Each door checks the caller first and the owner's door checks it again
//! (the headers go as they came), so every host and API process must share
//! the E2B API keys and the envd token secret ([`E2b::check_shared_secret`]
//! warns when it finds a token this process's secret did not make).
//! Refusals keep the door's error shapes: the control plane's, `/files`'
//! and ports' `{"code": <status>, "message": "<code>: …"}`, Connect errors
//! on envd.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use strata_core::SandboxId;
use stratad::api::forward::{door, DoorCall, DoorRefusal};
use stratad::caller::{Caller, SystemReason};
use stratad::security::auth::{is_token, TOKEN_PREFIX};
use stratad::store::SandboxFilter;

use crate::auth::{EnvdSandbox, Shape};
use crate::connect::{Code, ConnectError};
use crate::envd::SANDBOX_ID_HEADER;
use crate::error::E2bError;
use crate::E2b;

/// The control plane's (and `/files`') shape of a refusal:
/// `{"code": <status>, "message": "<code>: <message>"}`.
pub fn json_refusal(r: DoorRefusal) -> Response {
    E2bError::new(r.status.as_u16(), format!("{}: {}", r.code, r.message)).into_response()
}

/// A refusal as a Connect error of envd (an unreachable owner or a sandbox
/// no host holds is `unavailable`, a call an API process cannot serve
/// `failed_precondition`).
pub fn connect_refusal(r: &DoorRefusal) -> ConnectError {
    let code = match r.status.as_u16() {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::Aborted,
        413 | 429 | 507 => Code::ResourceExhausted,
        421 => Code::FailedPrecondition,
        502 | 503 => Code::Unavailable,
        _ => Code::Internal,
    };
    ConnectError::new(code, format!("{}: {}", r.code, r.message))
}

/// The sandbox id segment after `/sandboxes/` of a control-plane path.
fn path_sandbox(path: &str) -> Option<SandboxId> {
    let rest = path
        .strip_prefix("/v2/sandboxes/")
        .or_else(|| path.strip_prefix("/sandboxes/"))?;
    rest.split('/').next()?.parse().ok()
}

/// What a control-plane request is about (module docs).
fn control_call(st: &E2b, req: &Request) -> DoorCall {
    let Some(m) = req.extensions().get::<MatchedPath>() else {
        return DoorCall::Local;
    };
    let route = m.as_str();
    match route {
        "/sandboxes" | "/v2/sandboxes" if req.method() == Method::POST => DoorCall::Create {
            limit: st.cfg.max_request_bytes,
        },
        // A build's state is the building door's memory.
        "/v3/templates"
        | "/templates/:id/files/:hash"
        | "/v2/templates/:id/builds/:build"
        | "/templates/:id/builds/:build/status"
        | "/e2b-template-uploads/:token" => DoorCall::HostOnly,
        r if r.starts_with("/sandboxes/:id") || r.starts_with("/v2/sandboxes/:id") => {
            match path_sandbox(req.uri().path()) {
                Some(id) => DoorCall::Sandbox {
                    id,
                    read: req.method() == Method::GET,
                },
                // Not an id: the handler's 404.
                None => DoorCall::Local,
            }
        }
        _ => DoorCall::Local,
    }
}

/// Route layer of the control plane (inside the `X-API-KEY` check).
pub async fn control(State(st): State<Arc<E2b>>, mut req: Request, next: Next) -> Response {
    if st.svc.cluster().is_none() {
        return next.run(req).await;
    }
    let call = control_call(&st, &req);
    if matches!(call, DoorCall::Create { .. }) {
        bearer_of_key(&mut req);
    }
    door(&st.svc, call, req, json_refusal, |r| next.run(r)).await
}

/// A create whose `X-API-KEY` is a strata API token also carries it as
/// `Authorization`: the host that makes the sandbox fetches a template it
/// has no copy of from a holder with the caller's `Authorization`
/// (docs/cluster.md, "Templates across hosts"). A configured E2B key is no
/// credential of `/v1`: such a fetch is refused when authentication is on.
fn bearer_of_key(req: &mut Request) {
    if req.headers().contains_key(header::AUTHORIZATION) {
        return;
    }
    let Some(key) = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    else {
        return;
    };
    if !(key.starts_with(TOKEN_PREFIX) || is_token(key)) {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
        req.headers_mut().insert(header::AUTHORIZATION, v);
    }
}

/// Route layer of envd's Connect routes and `/files` (inside the
/// access-token or signed-URL check, which put the sandbox in the
/// request's extensions): the request goes to the sandbox's lease holder,
/// naming the sandbox by `E2b-Sandbox-Id` (a signed URL may not).
pub async fn envd(
    State((st, shape)): State<(Arc<E2b>, Shape)>,
    mut req: Request,
    next: Next,
) -> Response {
    if st.svc.cluster().is_none() {
        return next.run(req).await;
    }
    let Some(id) = req
        .extensions()
        .get::<EnvdSandbox>()
        .map(|s| s.0.id.clone())
    else {
        return next.run(req).await;
    };
    if let Ok(v) = HeaderValue::from_str(id.as_str()) {
        req.headers_mut().insert(SANDBOX_ID_HEADER, v);
    }
    let call = DoorCall::Sandbox { id, read: false };
    let shape_of = move |r: DoorRefusal| match shape {
        Shape::Files => json_refusal(r),
        s => s.refuse(connect_refusal(&r)),
    };
    door(&st.svc, call, req, shape_of, |r| next.run(r)).await
}

impl E2b {
    /// On a cluster, checks that this door's envd token secret is the one
    /// the other doors use: of the first live sandboxes (up to 50 a tenant of its keys) one with
    /// a stored envd token, its token made again here must be the stored
    /// one (its hash found); and the configured API key a token was handed
    /// to must be configured here too. A mismatch is logged as an error
    /// naming the fix (`e2b.secret` / `[e2b] token_secret_file` and `[e2b]
    /// api_keys` the same on every host and API process): such a door
    /// refuses the other doors' envd tokens and hands out tokens they
    /// refuse. `Ok(None)`: nothing to compare with yet (no stored token);
    /// `Ok(Some(id))`: the sandbox compared with matched.
    pub async fn check_shared_secret(&self) -> Result<Option<SandboxId>, String> {
        let Some(sec) = self.sec.clone() else {
            return Ok(None);
        };
        // The tenants of the configured keys' sandboxes (and `default`).
        let mut tenants = vec![stratad::store::DEFAULT_TENANT.to_owned()];
        for k in &self.cfg.api_keys {
            if !tenants.iter().any(|t| t == k.tenant()) {
                tenants.push(k.tenant().to_owned());
            }
        }
        let mut recs = Vec::new();
        for tenant in tenants {
            let filter = SandboxFilter {
                tenant,
                states: Vec::new(),
                labels: Default::default(),
                limit: 50,
                cursor: None,
            };
            let page = self
                .svc
                .list_sandboxes(&Caller::system(SystemReason::Embedder), filter)
                .await
                .map_err(|e| format!("listing sandboxes: {}", e.message()))?;
            recs.extend(page.items);
        }
        for rec in recs {
            let tokens = self
                .stored_envd_tokens(rec.id.as_str())
                .await
                .map_err(|e| e.message)?;
            let Some((token, caller)) = tokens.into_iter().next() else {
                continue;
            };
            let hash = crate::auth::token_hash(&token);
            let sec2 = sec.clone();
            let found = tokio::task::spawn_blocking(move || sec2.store().envd_token(&hash))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            if found.is_none_or(|(sid, _)| sid != rec.id.as_str()) {
                return Err(format!(
                    "the envd access token of sandbox {} was made with another secret than this door's: every host and API process of a cluster must have the same e2b.secret ([e2b] token_secret_file); until then the envd tokens this door hands out again (connect), its signed URLs and traffic tokens do not hold on the other processes",
                    rec.id
                ));
            }
            if let Caller::Api { token: key, .. } = &caller {
                let unknown = key.starts_with(crate::auth::KEY_ID_PREFIX)
                    && !self.cfg.api_keys.iter().any(|k| k.id() == key);
                if unknown {
                    return Err(format!(
                        "sandbox {}'s envd access token was handed to E2B API key {key}, which is not configured here: every host and API process of a cluster must have the same [e2b] api_keys (its envd calls answer 401 through this process)",
                        rec.id
                    ));
                }
            }
            return Ok(Some(rec.id));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    fn refusal(status: u16, code: &str) -> DoorRefusal {
        DoorRefusal {
            status: StatusCode::from_u16(status).unwrap(),
            code: code.into(),
            message: "host host-b cannot be reached".into(),
        }
    }

    #[test]
    fn control_paths_name_their_sandbox() {
        let id = "sb-0123456789abcdef";
        for p in [
            format!("/sandboxes/{id}"),
            format!("/sandboxes/{id}/pause"),
            format!("/v2/sandboxes/{id}/logs"),
        ] {
            assert_eq!(
                path_sandbox(&p).map(|s| s.to_string()),
                Some(id.into()),
                "{p}"
            );
        }
        assert_eq!(path_sandbox("/sandboxes/not-an-id"), None);
        assert_eq!(path_sandbox("/snapshots"), None);
    }

    #[tokio::test]
    async fn refusals_keep_the_door_shapes() {
        let r = json_refusal(refusal(503, "owner_unreachable"));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["code"], 503);
        assert_eq!(
            v["message"],
            "owner_unreachable: host host-b cannot be reached"
        );
        for (status, code) in [
            (503, Code::Unavailable),
            (502, Code::Unavailable),
            (421, Code::FailedPrecondition),
            (413, Code::ResourceExhausted),
            (500, Code::Internal),
        ] {
            let e = connect_refusal(&refusal(status, "x"));
            assert_eq!(e.code, code, "{status}");
            assert!(e.message.starts_with("x: "), "{}", e.message);
        }
    }
}
