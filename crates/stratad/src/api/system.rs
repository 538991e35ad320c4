//! `/healthz`, `/livez`, `/metrics`, `/v1/stats`, `/v1/openapi.json`, `/v1/ca`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde_json::json;

use super::{ApiResult, OPENAPI_JSON};
use crate::caller::Caller;
use crate::service::Service;

/// Readiness: answers `200` only when the store answers (a PostgreSQL
/// store that cannot be reached answers `503 storage_failed`).
pub(super) async fn healthz(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    // Answers only when the store answers.
    svc.refresh_gauges().await?;
    Ok(Json(
        json!({ "status": "ok", "version": strata_core::STRATA_VERSION }),
    ))
}

/// Liveness: answers `200` whenever the process serves HTTP, without
/// touching the store. A supervisor that restarts the daemon on a failed
/// liveness check (Kubernetes' `livenessProbe`, docs/kubernetes.md) must not
/// restart it because the store is away: a restart in a container ends its
/// VMs, and the store would still be away after it.
pub(super) async fn livez() -> impl IntoResponse {
    Json(json!({ "status": "ok", "version": strata_core::STRATA_VERSION }))
}

/// Prometheus text of the whole host (every tenant): the security layer
/// lets only metrics tokens and platform admins through.
pub(super) async fn metrics(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    svc.refresh_gauges().await?;
    let mut text = svc.metrics().render_prometheus();
    text.push_str(&svc.usage_prometheus().await);
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text))
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
    // The warm pools are the host's (a tenant's template would show in
    // them): the operator's view only.
    let operator = matches!(
        (caller.tenant(), caller.role()),
        (None, _) | (_, Some(crate::security::auth::Role::Admin))
    );
    let warm_pools = operator.then(|| svc.warm_pool_stats());
    // The host's figures are every tenant's load: the operator's view only.
    let host = if operator {
        Some(HostView {
            latest: svc.sampler().host_latest(),
            pool: svc.sampler().pool_latest(),
            admission: svc.config().capacity.admission,
            budget: svc.use_budget().await.ok(),
            pressure: svc.pressure_reading(),
        })
    } else {
        None
    };
    Ok(Json(StatsView {
        stats: s,
        warm_pools,
        host,
    }))
}

/// `/v1/stats` `host`: the host's CPU, memory, pressure and storage pool,
/// and what admission by use counts.
#[derive(serde::Serialize)]
struct HostView {
    /// The sampler's newest host point.
    latest: Option<crate::service::HostPoint>,
    /// The storage pool's space at the sampler's last round.
    pool: Option<crate::host::PoolSpace>,
    /// `[capacity] admission`.
    admission: crate::config::AdmissionMode,
    /// What admission by use counts now.
    budget: Option<crate::service::UseBudget>,
    /// The pressure monitor's last reading (absent when it is off).
    pressure: Option<crate::service::PressureReading>,
}

/// `/v1/stats`: the metrics' view, with the warm pools for the operator.
#[derive(serde::Serialize)]
struct StatsView {
    #[serde(flatten)]
    stats: crate::metrics::Stats,
    #[serde(skip_serializing_if = "Option::is_none")]
    warm_pools: Option<Vec<crate::service::WarmPoolStats>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host: Option<HostView>,
}

pub(super) async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}

/// The certificate of the local CA that signs the TLS listener's leaves
/// (`[e2b] tls_listen`), PEM; `404 not_found` while TLS is off.
pub(super) async fn ca(State(svc): State<Arc<Service>>) -> ApiResult<impl IntoResponse> {
    let cfg = svc.config();
    let path = crate::tls::ca_pem_path(&cfg.data_dir);
    let pem = match cfg.e2b.tls_listen {
        Some(_) => tokio::fs::read_to_string(&path).await.ok(),
        None => None,
    };
    let pem = pem.ok_or_else(|| {
        super::ApiError::new(
            strata_core::ErrorCode::NotFound,
            "no local CA: TLS for routed hosts is off ([e2b] tls_listen, --e2b-tls-listen)",
        )
    })?;
    Ok(([(header::CONTENT_TYPE, "application/x-pem-file")], pem))
}
