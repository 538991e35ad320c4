//! Moving a sandbox between deployments (docs/move.md): the sender's
//! `POST /v1/sandboxes/{id}/push` and the receiver's `/v1/imports/{id}…`
//! routes (offer, one snapshot stream, register); the puller's
//! `POST /v1/pulls` and the owner's `POST|GET /v1/sandboxes/{id}/export`
//! (manifest, one snapshot stream); a move inside a cluster,
//! `POST /v1/sandboxes/{id}/move`, and its target's
//! `POST /v1/imports/{id}/adopt`.

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use futures::TryStreamExt;
use serde::Deserialize;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId, SnapshotId};

use super::{declares_more_than, ApiError, ApiResult, Body, Call};
use crate::engine::RuntimeError;
use crate::service::{
    AdoptMove, Adoption, MoveSandbox, PullSandbox, PushSandbox, RegisterImport,
    MAX_SNAPSHOT_STREAM_BYTES,
};

/// `POST /v1/imports/{id}/offer` body: the sender's snapshot ids.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OfferBody {
    snapshots: Vec<SnapshotId>,
}

pub(super) async fn offer(c: Call, Body(b): Body<OfferBody>) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: SandboxId = c.id()?;
    let held = c.svc.import_offer(&c.caller, &id, b.snapshots).await?;
    Ok(Json(json!({ "held": held })))
}

/// `PUT /v1/imports/{id}/snapshots?snapshot=S[&parent=IDENTITY]`: the body
/// is a `btrfs send` stream, read as it comes and bounded.
pub(super) async fn receive(c: Call, req: axum::extract::Request) -> ApiResult<impl IntoResponse> {
    let params = c.params(&["snapshot", "parent"], &[], false)?;
    let id: SandboxId = c.id()?;
    let snap: SnapshotId = super::parse_id(
        params
            .one("snapshot")
            .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "snapshot: required"))?,
    )?;
    let parent = params.one("parent").map(str::to_owned);
    if declares_more_than(req.headers(), MAX_SNAPSHOT_STREAM_BYTES) {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("a snapshot stream is at most {MAX_SNAPSHOT_STREAM_BYTES} bytes"),
        ));
    }
    let body = req
        .into_body()
        .into_data_stream()
        .map_err(|e| RuntimeError::Invalid(format!("request body: {e}")));
    let bytes = c
        .svc
        .import_snapshot(&c.caller, &id, &snap, parent, Box::pin(body))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "snapshot": snap, "bytes": bytes })),
    ))
}

pub(super) async fn register(
    c: Call,
    Body(b): Body<RegisterImport>,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok((
        StatusCode::CREATED,
        Json(c.svc.import_register(&c.caller, &id, b, &opts).await?),
    ))
}

pub(super) async fn push(c: Call, Body(b): Body<PushSandbox>) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.push(&c.caller, &id, b, &opts).await?))
}

pub(super) async fn pull(c: Call, Body(b): Body<PullSandbox>) -> ApiResult<impl IntoResponse> {
    let opts = c.gate()?;
    Ok((
        StatusCode::CREATED,
        Json(c.svc.pull(&c.caller, b, &opts).await?),
    ))
}

pub(super) async fn export(c: Call) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.export(&c.caller, &id, &opts).await?))
}

/// `GET /v1/sandboxes/{id}/export?snapshot=S[&parent=IDENTITY]`: the body
/// is a `btrfs send` stream, sent as it is read.
pub(super) async fn export_snapshot(c: Call) -> ApiResult<axum::response::Response> {
    let params = c.params(&["snapshot", "parent"], &[], true)?;
    let id: SandboxId = c.id()?;
    let opts = params.gate_options()?;
    let stream = c
        .svc
        .export_snapshot(
            &c.caller,
            &id,
            params.one("snapshot"),
            params.one("parent"),
            &opts,
        )
        .await?;
    let body =
        axum::body::Body::from_stream(stream.map_err(|e| std::io::Error::other(e.message())));
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        body,
    )
        .into_response())
}

/// `POST /v1/sandboxes/{id}/move` (a cluster host; docs/move.md): the
/// caller's `Authorization` goes on to the target host, which checks it
/// again.
pub(super) async fn move_sandbox(
    c: Call,
    headers: axum::http::HeaderMap,
    Body(b): Body<MoveSandbox>,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let report = c.svc.move_sandbox(&c.caller, &id, b, auth, &opts).await?;
    // Moved, but the target has not confirmed taking it up (its adopt
    // call was lost and PostgreSQL did not show its take-up in time).
    let status = if report.adoption == Adoption::Unconfirmed {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(report)))
}

/// `POST /v1/imports/{id}/adopt`: the target's side of a move.
pub(super) async fn adopt(c: Call, Body(b): Body<AdoptMove>) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: SandboxId = c.id()?;
    Ok(Json(c.svc.adopt_move(&c.caller, &id, b).await?))
}

/// The `Authorization` value of a host route ("" when absent: refused by
/// the credential check).
fn host_auth(headers: &axum::http::HeaderMap) -> &str {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// `POST /v1/cluster/replicas/{id}/offer` (a host of the cluster with its
/// host credential; docs/cluster.md "Replicas"): which snapshots this host
/// holds for the sandbox.
pub(super) async fn replica_offer(
    axum::extract::State(svc): axum::extract::State<std::sync::Arc<crate::service::Service>>,
    super::PathId(id): super::PathId,
    headers: axum::http::HeaderMap,
    Body(b): Body<OfferBody>,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = super::parse_id(&id)?;
    let held = svc
        .replica_offer(host_auth(&headers), &id, b.snapshots)
        .await?;
    Ok(Json(json!({ "held": held })))
}

/// The query of `PUT /v1/cluster/replicas/{id}/snapshots`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicaQuery {
    snapshot: String,
    #[serde(default)]
    parent: Option<String>,
}

/// `PUT /v1/cluster/replicas/{id}/snapshots?snapshot=S[&parent=IDENTITY]`
/// (host credential): the body is a `btrfs send` stream, bounded.
pub(super) async fn replica_receive(
    axum::extract::State(svc): axum::extract::State<std::sync::Arc<crate::service::Service>>,
    super::PathId(id): super::PathId,
    query: Result<axum::extract::Query<ReplicaQuery>, axum::extract::rejection::QueryRejection>,
    req: axum::extract::Request,
) -> ApiResult<impl IntoResponse> {
    let id: SandboxId = super::parse_id(&id)?;
    let axum::extract::Query(q) =
        query.map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.body_text()))?;
    let snap: SnapshotId = super::parse_id(&q.snapshot)?;
    if declares_more_than(req.headers(), MAX_SNAPSHOT_STREAM_BYTES) {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("a snapshot stream is at most {MAX_SNAPSHOT_STREAM_BYTES} bytes"),
        ));
    }
    let auth = host_auth(req.headers()).to_owned();
    let body = req
        .into_body()
        .into_data_stream()
        .map_err(|e| RuntimeError::Invalid(format!("request body: {e}")));
    let bytes = svc
        .replica_receive(&auth, &id, &snap, q.parent, Box::pin(body))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "snapshot": snap, "bytes": bytes })),
    ))
}
