//! Templates: build (asynchronous, `202`; from the image or a recipe),
//! list, get (with progress), the build log, delete; the `copy` archives a
//! recipe build unpacks (`PUT|GET /v1/template-files/{sha256}`).

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use futures::StreamExt;
use serde_json::json;
use strata_core::{ErrorCode, TemplateId};

use super::{ApiError, ApiResult, Body, Call};
use crate::engine::RuntimeError;
use crate::service::BuildTemplate;

pub(super) async fn build(c: Call, Body(cmd): Body<BuildTemplate>) -> ApiResult<impl IntoResponse> {
    let opts = c.gate()?;
    Ok((
        StatusCode::ACCEPTED,
        Json(c.svc.build_template(&c.caller, cmd, &opts).await?),
    ))
}

pub(super) async fn list(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    Ok(Json(
        json!({ "items": c.svc.list_templates(&c.caller).await? }),
    ))
}

pub(super) async fn get(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: TemplateId = c.id()?;
    let view = c.svc.get_template(&c.caller, &id).await?;
    let mut v = serde_json::to_value(&view).unwrap_or_default();
    // On a cluster host: the hosts whose pools hold it (docs/cluster.md
    // "Templates across hosts").
    if let Some(cl) = c.svc.cluster() {
        v["hosts"] = json!(cl.template_holders(&id).await?);
    }
    Ok(Json(v))
}

/// `POST /v1/templates/{id}/variants` `{"vcpus", "memory_mib"}`: builds
/// the template's variant of that size ahead of the creates that will use
/// it (`202` with its progress; `200` when it is built, or the template is
/// of that size already).
pub(super) async fn build_variant(
    c: Call,
    Body(size): Body<crate::service::SizeSpec>,
) -> ApiResult<impl IntoResponse> {
    let opts = c.gate()?;
    let id: TemplateId = c.id()?;
    let v = c.svc.build_variant(&c.caller, &id, size, &opts).await?;
    let status = match v.record.status {
        crate::store::TemplateStatus::Building => StatusCode::ACCEPTED,
        _ => StatusCode::OK,
    };
    Ok((status, Json(v)))
}

/// `GET /v1/templates/{id}/variants`: the template's size variants.
pub(super) async fn list_variants(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let id: TemplateId = c.id()?;
    Ok(Json(
        json!({ "items": c.svc.list_variants(&c.caller, &id).await? }),
    ))
}

/// `GET /v1/templates/{id}/stream[?parent=TPL&identity=IDENTITY]`: the
/// template as a `btrfs send` stream, for another host of the cluster
/// (docs/cluster.md "Templates across hosts"); incremental against template
/// `parent` when this host holds it under that identity (the answer's
/// `x-strata-stream-parent` names the parent identity used; absent: full).
pub(super) async fn stream(c: Call) -> ApiResult<axum::response::Response> {
    let params = c.params(&["parent", "identity"], &[], false)?;
    let id: TemplateId = c.id()?;
    let parent = match (params.one("parent"), params.one("identity")) {
        (None, None) => None,
        (Some(p), Some(i)) => Some((super::parse_id::<TemplateId>(p)?, i.to_owned())),
        _ => {
            return Err(super::ApiError::new(
                strata_core::ErrorCode::InvalidRequest,
                "parent and identity go together",
            ))
        }
    };
    let (stream, used) = c.svc.stream_template(&c.caller, &id, parent).await?;
    let body = axum::body::Body::from_stream(futures::TryStreamExt::map_err(stream, |e| {
        std::io::Error::other(e.message())
    }));
    let mut resp = (
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        body,
    )
        .into_response();
    if let Some(v) = used.and_then(|u| u.parse().ok()) {
        resp.headers_mut()
            .insert(crate::cluster::templates::STREAM_PARENT_HEADER, v);
    }
    Ok(resp)
}

/// `POST /v1/templates/{id}/replicate` body.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicateBody {
    host: String,
}

/// `POST /v1/templates/{id}/replicate {"host": H}`: copies the template
/// into host H's pool (from a live host that holds it); answered by H
/// (another host forwards the call there with the caller's credentials).
pub(super) async fn replicate(
    c: Call,
    Body(b): Body<ReplicateBody>,
) -> ApiResult<axum::response::Response> {
    c.no_query()?;
    let id: TemplateId = c.id()?;
    Ok(c.svc.replicate_template(&c.caller, &id, &b.host).await?)
}

pub(super) async fn delete(c: Call) -> ApiResult<impl IntoResponse> {
    let id: TemplateId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.delete_template(&c.caller, &id, &opts).await?))
}

/// `GET /v1/templates/{id}/logs?offset=N`: the build log from byte `N`
/// (at most 256 KiB a call): `{"data", "offset" (ask from here next),
/// "done" (the build is over and the log read to its end)}`.
pub(super) async fn logs(c: Call) -> ApiResult<impl IntoResponse> {
    let p = c.params(&["offset"], &[], false)?;
    let offset = match p.one("offset") {
        None => 0,
        Some(v) => v.parse::<u64>().map_err(|_| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("offset {v:?}: a byte offset (0 or more)"),
            )
        })?,
    };
    let id: TemplateId = c.id()?;
    let (data, next, done) = c.svc.template_log(&c.caller, &id, offset).await?;
    Ok(Json(json!({
        "data": String::from_utf8_lossy(&data),
        "offset": next,
        "done": done,
    })))
}

/// `PUT /v1/template-files/{sha256}`: stores a recipe's `copy` archive for
/// the caller's tenant (`201 {"sha256", "bytes"}`); its content must hash
/// to the name (`400`), at most `max_upload_bytes` (`413`).
pub(super) async fn put_file(c: Call, req: Request) -> ApiResult<impl IntoResponse> {
    let opts = c.gate()?;
    let limit = c.svc.config().max_upload_bytes;
    if super::declares_more_than(req.headers(), limit) {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("a template file may be at most {limit} bytes"),
        ));
    }
    let svc = c.svc.clone();
    let (caller, sha, _) = c.into_parts();
    let body = req
        .into_body()
        .into_data_stream()
        .map(|chunk| chunk.map_err(|e| RuntimeError::Other(format!("reading upload: {e}"))))
        .boxed();
    let n = svc.put_template_file(&caller, &sha, body, &opts).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "sha256": sha, "bytes": n })),
    ))
}

/// `GET|HEAD /v1/template-files/{sha256}`: `200` when the caller's tenant
/// uploaded it, `404` otherwise.
pub(super) async fn get_file(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let svc = c.svc.clone();
    let (caller, sha, _) = c.into_parts();
    if svc.has_template_file(&caller, &sha).await? {
        Ok(Json(json!({ "sha256": sha })))
    } else {
        Err(crate::service::ServiceError::NotFound {
            kind: "template file",
            id: sha,
        }
        .into())
    }
}
