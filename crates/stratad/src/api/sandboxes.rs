//! Sandboxes, exec, snapshots, fork and rewind.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use base64::Engine as _;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId, SandboxState, SnapshotId};

use super::{ndjson_headers, ApiError, ApiResult, Body, Call};
use crate::engine::{Command, ExecEvent, ExecRequest, Stdin};
use crate::service::{
    CreateSandbox, PatchSandbox, Rewind, SandboxSpec, TakeSnapshot, TenantDefaults,
};
use crate::store::SandboxFilter;

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg)
}

/// `POST /v1/sandboxes` body: [`CreateSandbox`] plus `start`.
#[derive(Debug, Deserialize)]
pub(super) struct CreateBody {
    /// `false`: create the sandbox hibernated, without starting a VM; its
    /// first use wakes it. Default `true`.
    #[serde(default = "yes")]
    start: bool,
    #[serde(flatten)]
    cmd: CreateSandbox,
}

fn yes() -> bool {
    true
}

impl Default for CreateBody {
    fn default() -> Self {
        CreateBody {
            start: true,
            cmd: CreateSandbox::default(),
        }
    }
}

pub(super) async fn create(c: Call, Body(body): Body<CreateBody>) -> ApiResult<impl IntoResponse> {
    let opts = c.gate()?;
    let rec = if body.start {
        c.svc.create(&c.caller, body.cmd, &opts).await?
    } else {
        c.svc.create_hibernated(&c.caller, body.cmd, &opts).await?
    };
    Ok((StatusCode::CREATED, Json(rec)))
}

pub(super) async fn list(c: Call) -> ApiResult<impl IntoResponse> {
    // `state` and `label` repeat (the CLI sends one per filter); the rest may not.
    let params = c.params(
        &["state", "label", "limit", "cursor"],
        &["state", "label"],
        false,
    )?;
    let mut f = SandboxFilter {
        limit: 100,
        ..Default::default()
    };
    for v in params.all("state") {
        for s in v.split(',') {
            f.states.push(s.parse::<SandboxState>().map_err(invalid)?);
        }
    }
    let mut labels = BTreeMap::new();
    for v in params.all("label") {
        let (lk, lv) = v
            .split_once('=')
            .ok_or_else(|| invalid(format!("label filter {v:?}: expected KEY=VALUE")))?;
        labels.insert(lk.to_owned(), lv.to_owned());
    }
    if let Some(v) = params.one("limit") {
        f.limit = v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| invalid(format!("limit {v:?}: expected 1..=1000")))?;
    }
    f.cursor = params.one("cursor").map(str::to_owned);
    f.labels = labels;
    Ok(Json(c.svc.list_sandboxes(&c.caller, f).await?))
}

pub(super) async fn get(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: SandboxId = c.id()?;
    view(&c, &id).await
}

/// `PATCH /v1/sandboxes/{id}`: settings kept beside the record
/// ([`PatchSandbox`]); answers the sandbox as `GET` does.
pub(super) async fn patch(c: Call, Body(b): Body<PatchSandbox>) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    c.svc.patch_sandbox(&c.caller, &id, b, &opts).await?;
    view(&c, &id).await
}

/// `GET /v1/settings`: the caller's tenant's defaults for new sandboxes.
pub(super) async fn get_settings(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    Ok(Json(c.svc.tenant_defaults(&c.caller).await?))
}

/// `PUT /v1/settings` (admin): changes them; a field left out is unchanged.
pub(super) async fn put_settings(
    c: Call,
    Body(b): Body<TenantDefaults>,
) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    Ok(Json(c.svc.set_tenant_defaults(&c.caller, b).await?))
}

/// A sandbox as `GET /v1/sandboxes/{id}` shows it.
async fn view(c: &Call, id: &SandboxId) -> ApiResult<Json<serde_json::Value>> {
    let id = id.clone();
    let rec = c.svc.get_sandbox(&c.caller, &id).await?;
    // The record and, beside it, its lifecycle policy (kept in its own table).
    let policy = c.svc.lifecycle_policy(&c.caller, &id).await?;
    let mut v = serde_json::to_value(&rec).unwrap_or_default();
    v["lifecycle"] = serde_json::to_value(policy).unwrap_or_default();
    // Replication (docs/cluster.md "Replicas"): the setting, and on a
    // cluster host the lease holder and the replicas.
    if let serde_json::Value::Object(more) = c.svc.replication_view(&id).await? {
        for (k, x) in more {
            v[k] = x;
        }
    }
    Ok(Json(v))
}

pub(super) async fn delete(c: Call) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.delete(&c.caller, &id, &opts).await?))
}

pub(super) async fn pause(c: Call) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.pause(&c.caller, &id, &opts).await?))
}

pub(super) async fn resume(c: Call) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.resume(&c.caller, &id, &opts).await?))
}

/// `POST /v1/sandboxes/{id}/hibernate` body: `memory: false` keeps the
/// disk alone (the wake cold-boots). Empty: with memory.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HibernateBody {
    #[serde(default = "yes")]
    memory: bool,
}

impl Default for HibernateBody {
    fn default() -> Self {
        HibernateBody { memory: true }
    }
}

pub(super) async fn hibernate(
    c: Call,
    Body(body): Body<HibernateBody>,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(
        c.svc
            .hibernate_with(&c.caller, &id, &opts, body.memory)
            .await?,
    ))
}

pub(super) async fn fork(c: Call, Body(spec): Body<SandboxSpec>) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok((
        StatusCode::CREATED,
        Json(c.svc.fork_sandbox(&c.caller, &id, spec, &opts).await?),
    ))
}

pub(super) async fn fork_snapshot(
    c: Call,
    Body(spec): Body<SandboxSpec>,
) -> ApiResult<impl IntoResponse> {
    let id: SnapshotId = c.id()?;
    let opts = c.gate()?;
    Ok((
        StatusCode::CREATED,
        Json(c.svc.fork_snapshot(&c.caller, &id, spec, &opts).await?),
    ))
}

/// `POST /v1/sandboxes/{id}/rewind` body (exactly one field).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RewindBody {
    #[serde(default)]
    to: Option<SnapshotId>,
    #[serde(default)]
    ago: Option<String>,
}

pub(super) async fn rewind(c: Call, Body(b): Body<RewindBody>) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    let (sandbox, to, pre) = c
        .svc
        .rewind(
            &c.caller,
            &id,
            Rewind {
                to: b.to,
                ago: b.ago,
            },
            &opts,
        )
        .await?;
    Ok(Json(
        json!({ "sandbox": sandbox, "rewound_to": to, "pre_rewind_snapshot": pre }),
    ))
}

pub(super) async fn take_snapshot(
    c: Call,
    Body(cmd): Body<TakeSnapshot>,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok((
        StatusCode::CREATED,
        Json(c.svc.take_snapshot(&c.caller, &id, cmd, &opts).await?),
    ))
}

pub(super) async fn list_snapshots(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: SandboxId = c.id()?;
    Ok(Json(
        json!({ "items": c.svc.list_snapshots(&c.caller, &id).await? }),
    ))
}

pub(super) async fn get_snapshot(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: SnapshotId = c.id()?;
    Ok(Json(c.svc.get_snapshot(&c.caller, &id).await?))
}

pub(super) async fn delete_snapshot(c: Call) -> ApiResult<impl IntoResponse> {
    let id: SnapshotId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.delete_snapshot(&c.caller, &id, &opts).await?))
}

/// `POST /v1/sandboxes/{id}/exec` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExecBody {
    cmd: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
    /// Base64 bytes for the command's stdin.
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    timeout_s: Option<u64>,
    /// Run on a pseudo-terminal of this size (docs/pty.md).
    #[serde(default)]
    tty: Option<crate::engine::PtySize>,
}

impl ExecBody {
    /// The command the body asks for.
    pub(super) fn into_request(self) -> ApiResult<ExecRequest> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let stdin = match self.stdin {
            Some(s) => Stdin::Bytes(
                b64.decode(s.as_bytes())
                    .map_err(|e| invalid(format!("stdin: not base64: {e}")))?,
            ),
            None => Stdin::Null,
        };
        Ok(ExecRequest {
            command: Command::Argv(self.cmd),
            env: self.env,
            cwd: self.cwd,
            user: None,
            stdin,
            timeout: self.timeout_s.map(std::time::Duration::from_secs),
            pty: self.tty,
        })
    }
}

fn line(v: serde_json::Value) -> Result<bytes::Bytes, std::convert::Infallible> {
    let mut s = v.to_string();
    s.push('\n');
    Ok(bytes::Bytes::from(s))
}

/// A command's events as the NDJSON response body of exec.
pub(super) fn ndjson_events(stream: crate::engine::ExecStream) -> axum::body::Body {
    let b64 = base64::engine::general_purpose::STANDARD;
    let body = stream.filter_map(move |ev| {
        futures::future::ready(match ev {
            Ok(ExecEvent::Started { .. }) => None,
            Ok(ExecEvent::Stdout(d)) => Some(line(json!({ "stdout": b64.encode(&d) }))),
            Ok(ExecEvent::Stderr(d)) => Some(line(json!({ "stderr": b64.encode(&d) }))),
            Ok(ExecEvent::Exit(s)) => Some(line(
                json!({ "exit": { "code": s.code, "signal": s.signal } }),
            )),
            Err(e) => Some(line(ApiError::new(e.code(), e.message()).body())),
        })
    });
    axum::body::Body::from_stream(body)
}

/// `POST /v1/sandboxes/{id}/exec`: a JSON body runs a command with its
/// stdin given; an NDJSON body (`Content-Type: application/x-ndjson`) is an
/// interactive exec whose input streams in the same request
/// ([`super::interactive`]).
pub(super) async fn exec(
    c: Call,
    req: axum::extract::Request,
) -> ApiResult<axum::response::Response> {
    if super::interactive::is_ndjson(req.headers()) {
        return super::interactive::exec(c, req.into_body()).await;
    }
    let Body(b) =
        <Body<ExecBody> as axum::extract::FromRequest<()>>::from_request(req, &()).await?;
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    let req = b.into_request()?;
    let stream = c.svc.exec(&c.caller, &id, req, &opts).await?;
    Ok((ndjson_headers(), ndjson_events(stream)).into_response())
}
