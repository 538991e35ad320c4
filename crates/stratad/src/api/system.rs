//! `/healthz`, `/metrics`, `/v1/stats`, `/v1/openapi.json`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde_json::json;

use super::{ApiResult, OPENAPI_JSON};
use crate::caller::Caller;
use crate::service::Service;

pub(super) async fn healthz(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    // Answers only when the store answers.
    svc.refresh_gauges().await?;
    Ok(Json(
        json!({ "status": "ok", "version": strata_core::STRATA_VERSION }),
    ))
}

/// Prometheus text of the whole host (every tenant): the security layer
/// lets only metrics tokens and platform admins through.
pub(super) async fn metrics(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    svc.refresh_gauges().await?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        svc.metrics().render_prometheus(),
    ))
}

/// The caller's tenant's view: its sandboxes by state, its ready
/// snapshots, the latency of its own API calls, and the host's VM steps.
pub(super) async fn stats(
    State(svc): State<Arc<Service>>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<impl IntoResponse> {
    let counts = svc.counts(&caller).await?;
    let mut s = svc.metrics().stats_for(caller.tenant());
    s.sandboxes = counts.sandboxes_by_state;
    s.snapshots = counts.snapshots_ready;
    Ok(Json(s))
}

pub(super) async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}
