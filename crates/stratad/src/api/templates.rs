//! Templates: build (asynchronous, `202`), list, get (with progress), delete.

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;
use strata_core::TemplateId;

use super::{ApiResult, Body, Call};
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
    Ok(Json(c.svc.get_template(&c.caller, &id).await?))
}

pub(super) async fn delete(c: Call) -> ApiResult<impl IntoResponse> {
    let id: TemplateId = c.id()?;
    let opts = c.gate()?;
    Ok(Json(c.svc.delete_template(&c.caller, &id, &opts).await?))
}
