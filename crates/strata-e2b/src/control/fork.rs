//! `POST /sandboxes/{id}/fork`: `count` forks of a live sandbox, each a
//! strata fork ([`stratad::service::Service::fork_sandbox`]: a new sandbox
//! from the source's present state, listed by `strata ls`, its snapshot by
//! `strata snapshots`). The source keeps running.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use strata_core::SandboxState;
use stratad::caller::Caller;
use stratad::service::SandboxSpec;

use super::{check_timeout, parse_body, sandbox_err, JsonBody, SandboxPath};
use crate::error::{E2bError, E2bResult};
use crate::policy::gate_opts;
use crate::E2b;

/// Most forks one request may ask for.
pub const MAX_FORK_COUNT: u64 = 16;

/// `SandboxForkRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

/// `POST /sandboxes/{id}/fork` → 201 `[SandboxForkResult]`: one entry per
/// fork, `{"sandbox": Sandbox}` or `{"error": {code, message}}`. An unknown
/// source (another tenant's included) answers 404, a `count` outside
/// `1..=16` 400, and a first fork that fails fails the whole request with
/// its error (it tells about the source: denied, wrong state); later
/// failures (room, pool) are per-fork entries. Forks inherit the source's
/// metadata and `envVars`; their timeout is the request's (default the
/// door's create default).
pub async fn fork(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: ForkBody = parse_body(&body)?;
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORK_COUNT).contains(&count) {
        return Err(E2bError::new(
            400,
            format!("count {count}: between 1 and {MAX_FORK_COUNT}"),
        ));
    }
    let timeout = check_timeout(req.timeout.unwrap_or(st.cfg.default_timeout_s))?.max(1);
    let src = st.record(&caller, &id).await?;
    if src.state == SandboxState::Failed {
        return Err(super::not_found(&id));
    }
    let envs = st.sandbox_envs(&src.id);
    let ports = st.port_settings(&src.id);
    let mut out: Vec<Value> = Vec::new();
    for i in 0..count {
        let spec = SandboxSpec {
            labels: src.labels.clone(),
            idle_timeout: Some(format!("{timeout}s")),
            ..SandboxSpec::default()
        };
        match st
            .svc
            .fork_sandbox(&caller, &src.id, spec, &gate_opts())
            .await
        {
            Ok(rec) => {
                let token = match st.issue(&rec.id, &caller).await {
                    Ok(t) => t,
                    Err(e) => {
                        // No envd call could reach it: not left behind.
                        let _ = st.svc.delete(&caller, &rec.id, &gate_opts()).await;
                        out.push(json!({ "error": { "code": e.status, "message": e.message } }));
                        continue;
                    }
                };
                st.keep_envs(&caller, &rec.id, envs.clone()).await;
                if let Err(e) = st.keep_port_settings(&caller, &rec.id, ports.clone()).await {
                    // A fork of a private sandbox is never served public.
                    let _ = st.svc.delete(&caller, &rec.id, &gate_opts()).await;
                    out.push(json!({ "error": { "code": e.status, "message": e.message } }));
                    continue;
                }
                out.push(json!({ "sandbox": st.sandbox_json(&rec, &token) }));
            }
            Err(e) if i == 0 => return Err(sandbox_err(&id)(e)),
            Err(e) => {
                let e = E2bError::from(e);
                out.push(json!({ "error": { "code": e.status, "message": e.message } }));
            }
        }
    }
    Ok((StatusCode::CREATED, Json(out)).into_response())
}
