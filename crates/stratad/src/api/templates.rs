//! Templates: build (asynchronous, `202`), list, get (with progress), delete.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde_json::json;
use strata_core::TemplateId;

use super::{gate_only, parse_id, ApiResult, Body, Params, PathId};
use crate::caller::Caller;
use crate::service::{BuildTemplate, Service};

pub(super) async fn build(
    State(svc): State<Arc<Service>>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
    Body(cmd): Body<BuildTemplate>,
) -> ApiResult<impl IntoResponse> {
    let opts = gate_only(q.as_deref())?;
    Ok((
        StatusCode::ACCEPTED,
        Json(svc.build_template(&caller, cmd, &opts).await?),
    ))
}

pub(super) async fn list(
    State(svc): State<Arc<Service>>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    Params::parse(q.as_deref(), &[], &[], false)?;
    Ok(Json(json!({ "items": svc.list_templates(&caller).await? })))
}

pub(super) async fn get(
    State(svc): State<Arc<Service>>,
    Extension(caller): Extension<Caller>,
    PathId(id): PathId,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    Params::parse(q.as_deref(), &[], &[], false)?;
    let id: TemplateId = parse_id(&id)?;
    Ok(Json(svc.get_template(&caller, &id).await?))
}

pub(super) async fn delete(
    State(svc): State<Arc<Service>>,
    Extension(caller): Extension<Caller>,
    PathId(id): PathId,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let id: TemplateId = parse_id(&id)?;
    let opts = gate_only(q.as_deref())?;
    Ok(Json(svc.delete_template(&caller, &id, &opts).await?))
}
