//! Guest files: upload and download stream; list, stat, mkdir, remove.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use futures::StreamExt;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId};
use strata_policy::CallKind;

use super::{ApiError, ApiResult, Call, Params};
use crate::engine::RuntimeError;
use crate::security::gate::GateOptions;
use crate::service::Grant;

/// Query parameters of the file endpoints, parsed once: the path the gate
/// decides on is the path the action uses.
#[derive(Debug, Default)]
struct FileQuery {
    path: String,
    mode: Option<u32>,
    parents: bool,
    recursive: bool,
    gate: GateOptions,
}

impl FileQuery {
    fn read(&self) -> CallKind {
        CallKind::FileRead {
            path: self.path.clone(),
        }
    }

    fn write(&self) -> CallKind {
        CallKind::FileWrite {
            path: self.path.clone(),
        }
    }
}

/// Looks the caller's sandbox up and gates `kind` on it.
async fn grant(c: &Call, q: &FileQuery, kind: CallKind) -> ApiResult<Grant> {
    let id: SandboxId = c.id()?;
    Ok(c.svc.grant(&c.caller, &id, kind, &q.gate).await?)
}

fn file_query(raw: Option<&str>, extra: &[&str]) -> ApiResult<FileQuery> {
    let mut allowed = vec!["path"];
    allowed.extend_from_slice(extra);
    // No key repeats: `?path=a&path=b` is refused, not read two ways.
    let p = Params::parse(raw, &allowed, &[], true)?;
    let mut q = FileQuery {
        gate: p.gate_options()?,
        ..FileQuery::default()
    };
    q.path = p
        .one("path")
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "missing query parameter `path`"))?
        .to_owned();
    if let Some(v) = p.one("mode") {
        q.mode = Some(u32::from_str_radix(v, 8).map_err(|_| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("mode {v:?}: expected octal, e.g. 644"),
            )
        })?)
    }
    q.parents = p.flag("parents", q.parents)?;
    q.recursive = p.flag("recursive", q.recursive)?;
    crate::service::validate_guest_path(&q.path)?;
    Ok(q)
}

pub(super) async fn download(c: Call) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &[])?;
    let g = grant(&c, &q, q.read()).await?;
    let stream = c.svc.read_file(&g, &q.path).await?;
    let body = stream.map(|r| r.map_err(std::io::Error::other));
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        axum::body::Body::from_stream(body),
    ))
}

pub(super) async fn upload(c: Call, req: Request) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &["mode"])?;
    let limit = c.svc.config().max_upload_bytes;
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("upload larger than {limit} bytes"),
        )
    };
    if super::declares_more_than(req.headers(), limit) {
        return Err(too_large());
    }
    let id: SandboxId = c.id()?;
    if c.svc.upload_is_held(&c.caller, &id, &q.write(), &q.gate) {
        return upload_held(&c, &id, &q, req).await;
    }
    let g = grant(&c, &q, q.write()).await?;
    // Counted as it streams: a chunked body over the limit is cut off.
    let seen = Arc::new(AtomicU64::new(0));
    let exceeded = Arc::new(AtomicBool::new(false));
    let (seen2, exceeded2) = (seen.clone(), exceeded.clone());
    let body = req.into_body().into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(|e| RuntimeError::Other(format!("reading upload: {e}")))?;
        let total = seen2.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
        if total > limit {
            exceeded2.store(true, Ordering::Relaxed);
            return Err(RuntimeError::Other("upload over the size limit".into()));
        }
        Ok(chunk)
    });
    match c
        .svc
        .write_file(&g, &q.path, q.mode.unwrap_or(0o644), body.boxed())
        .await
    {
        Ok(n) => Ok((
            StatusCode::CREATED,
            Json(json!({ "path": q.path, "bytes": n })),
        )
            .into_response()),
        Err(_) if exceeded.load(Ordering::Relaxed) => Err(too_large()),
        Err(e) => Err(e.into()),
    }
}

/// An upload the policy holds (or a re-sent one, `?approval=<id>`): read
/// to a bounded file first, so the approval is bound to the size and
/// SHA-256 of the bytes written (`service::held`).
async fn upload_held(
    c: &Call,
    id: &SandboxId,
    q: &FileQuery,
    req: Request,
) -> ApiResult<axum::response::Response> {
    // An unknown (or another tenant's) sandbox is refused before any byte
    // is read.
    c.svc.get_sandbox(&c.caller, id).await?;
    let held = c
        .svc
        .hold_upload(req.into_body().into_data_stream())
        .await?;
    let g = c
        .svc
        .grant_held(&c.caller, id, q.write(), &q.gate, &held)
        .await?;
    let n = c
        .svc
        .write_held(&g, &q.path, q.mode.unwrap_or(0o644), held)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "path": q.path, "bytes": n })),
    )
        .into_response())
}

pub(super) async fn list(c: Call) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &[])?;
    let g = grant(&c, &q, q.read()).await?;
    Ok(Json(json!({ "items": c.svc.list_dir(&g, &q.path).await? })))
}

pub(super) async fn stat(c: Call) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &[])?;
    let g = grant(&c, &q, q.read()).await?;
    Ok(Json(c.svc.stat(&g, &q.path).await?))
}

pub(super) async fn mkdir(c: Call) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &["parents"])?;
    let g = grant(&c, &q, q.write()).await?;
    c.svc.mkdir(&g, &q.path, q.parents).await?;
    Ok((StatusCode::CREATED, Json(json!({ "path": q.path }))))
}

pub(super) async fn remove(c: Call) -> ApiResult<impl IntoResponse> {
    let q = file_query(c.query(), &["recursive"])?;
    let g = grant(&c, &q, q.write()).await?;
    c.svc.remove(&g, &q.path, q.recursive).await?;
    Ok(Json(json!({ "path": q.path, "removed": true })))
}
