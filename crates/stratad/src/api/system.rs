//! `/healthz`, `/metrics`, `/v1/stats`, `/v1/openapi.json`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use super::{ApiResult, OPENAPI_JSON};
use crate::service::Service;

pub(super) async fn healthz(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    // Answers only when the store answers.
    svc.db(|s| s.counts()).await?;
    Ok(Json(
        json!({ "status": "ok", "version": strata_core::STRATA_VERSION }),
    ))
}

pub(super) async fn metrics(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    svc.refresh_gauges().await?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        svc.metrics().render_prometheus(),
    ))
}

pub(super) async fn stats(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    let counts = svc.refresh_gauges().await?;
    let mut s = svc.metrics().stats();
    s.sandboxes = counts.sandboxes_by_state;
    s.snapshots = counts.snapshots_ready;
    Ok(Json(s))
}

pub(super) async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}
