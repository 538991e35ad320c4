//! Templates: build (asynchronous, `202`), list, get (with progress), delete.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;
use strata_core::TemplateId;

use super::{parse_id, ApiResult, Body};
use crate::service::{BuildTemplate, Service};

pub(super) async fn build(
    State(svc): State<Arc<Service>>,
    Body(cmd): Body<BuildTemplate>,
) -> ApiResult<impl IntoResponse> {
    Ok((StatusCode::ACCEPTED, Json(svc.build_template(cmd).await?)))
}

pub(super) async fn list(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    Ok(Json(json!({ "items": svc.list_templates().await? })))
}

pub(super) async fn get(
    State(svc): State<Arc<Service>>,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    let id: TemplateId = parse_id(&id)?;
    Ok(Json(svc.get_template(&id).await?))
}

pub(super) async fn delete(
    State(svc): State<Arc<Service>>,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    let id: TemplateId = parse_id(&id)?;
    Ok(Json(svc.delete_template(&id).await?))
}
