//! The HTTP API (axum): thin handlers that parse requests into the service's
//! typed commands and map [`ServiceError`]s onto `{ "error": { "code", "message" } }`
//! with the code's HTTP status.
//!
//! Framing choices:
//! - exec answers `application/x-ndjson`, one JSON object per line, as the
//!   output comes: `{"stdout":"<base64>"}`, `{"stderr":"<base64>"}`, finally
//!   `{"exit":{"code":0,"signal":null}}`; a failure after the response
//!   started is a last line `{"error":{"code":…,"message":…}}`.
//! - file content travels as the raw body, streamed both ways; the guest
//!   path is the `path` query parameter (absolute, no `..`, no NUL).
//! - list endpoints return `{ "items": [...], "next_cursor": "..." }`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde_json::json;
use strata_core::ErrorCode;
use tracing::Instrument;

use crate::service::{Service, ServiceError};

mod files;
mod sandboxes;
pub mod security;
mod system;
mod templates;

/// The OpenAPI document (checked in, served at `/v1/openapi.json`).
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");

/// Every route: `(method, path)` in axum syntax. The OpenAPI test checks
/// that each one is documented and answers.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("GET", "/v1/openapi.json"),
    ("GET", "/v1/stats"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/:id"),
    ("DELETE", "/v1/sandboxes/:id"),
    ("POST", "/v1/sandboxes/:id/exec"),
    ("POST", "/v1/sandboxes/:id/pause"),
    ("POST", "/v1/sandboxes/:id/resume"),
    ("POST", "/v1/sandboxes/:id/hibernate"),
    ("POST", "/v1/sandboxes/:id/fork"),
    ("POST", "/v1/sandboxes/:id/rewind"),
    ("GET", "/v1/sandboxes/:id/events"),
    ("POST", "/v1/sandboxes/:id/snapshots"),
    ("GET", "/v1/sandboxes/:id/snapshots"),
    ("GET", "/v1/sandboxes/:id/files"),
    ("PUT", "/v1/sandboxes/:id/files"),
    ("DELETE", "/v1/sandboxes/:id/files"),
    ("GET", "/v1/sandboxes/:id/files/list"),
    ("GET", "/v1/sandboxes/:id/files/stat"),
    ("POST", "/v1/sandboxes/:id/files/mkdir"),
    ("GET", "/v1/snapshots/:id"),
    ("DELETE", "/v1/snapshots/:id"),
    ("POST", "/v1/snapshots/:id/fork"),
    ("POST", "/v1/templates"),
    ("GET", "/v1/templates"),
    ("GET", "/v1/templates/:id"),
    ("DELETE", "/v1/templates/:id"),
    // Security (api::security::SECURITY_ROUTES).
    ("GET", "/v1/whoami"),
    ("POST", "/v1/tokens"),
    ("GET", "/v1/tokens"),
    ("DELETE", "/v1/tokens/:id"),
    ("GET", "/v1/policy"),
    ("PUT", "/v1/policy"),
    ("POST", "/v1/policy/test"),
    ("GET", "/v1/sandboxes/:id/policy"),
    ("PUT", "/v1/sandboxes/:id/policy"),
    ("GET", "/v1/sandboxes/:id/egress"),
    ("GET", "/v1/approvals"),
    ("GET", "/v1/approvals/:id"),
    ("POST", "/v1/approvals/:id/approve"),
    ("POST", "/v1/approvals/:id/deny"),
    ("GET", "/v1/audit"),
    ("GET", "/v1/audit/verify"),
];

/// An API error: a stable code, its HTTP status and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// Human message.
    pub message: String,
}

impl ApiError {
    /// An error with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "code": self.code, "message": self.message } })
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        if matches!(e.code(), ErrorCode::Internal) {
            tracing::error!(error = %e.message(), "internal error");
        }
        ApiError::new(e.code(), e.message())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.body())).into_response()
    }
}

/// Result of handlers.
pub type ApiResult<T> = Result<T, ApiError>;

/// A JSON body parsed strictly: malformed JSON, wrong types and unknown
/// fields are `400 invalid_request`, a body over the limit `413`. An empty
/// body is the command's default (for commands where every field is optional).
#[derive(Debug)]
pub struct Body<T>(pub T);

#[axum::async_trait]
impl<T, S> FromRequest<S> for Body<T>
where
    T: DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    "request body is larger than the limit",
                )
            } else {
                ApiError::new(ErrorCode::InvalidRequest, rej.body_text())
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        serde_json::from_slice(&bytes).map(Body).map_err(|e| {
            ApiError::new(ErrorCode::InvalidRequest, format!("invalid JSON body: {e}"))
        })
    }
}

/// Query parameters as `(key, value)` pairs (repeated keys allowed).
pub(crate) fn query_pairs(raw: Option<&str>) -> Vec<(String, String)> {
    raw.map(|q| {
        form_urlencoded::parse(q.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect()
    })
    .unwrap_or_default()
}

/// A parsed id from the path (malformed: `400 invalid_request`).
pub(crate) fn parse_id<T: std::str::FromStr>(s: &str) -> ApiResult<T>
where
    T::Err: std::fmt::Display,
{
    s.parse()
        .map_err(|e: T::Err| ApiError::new(ErrorCode::InvalidRequest, e.to_string()))
}

fn sandbox_of(path: &str) -> &str {
    let mut it = path.split('/').skip(1);
    match (it.next(), it.next(), it.next()) {
        (Some("v1"), Some("sandboxes"), Some(id)) => id,
        _ => "",
    }
}

/// Records latency per operation and puts the sandbox id on the request's span.
async fn track(State(svc): State<Arc<Service>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let op = format!("{} {}", req.method(), route);
    let sandbox = sandbox_of(req.uri().path()).to_owned();
    let span = tracing::info_span!("request", op = %op, sandbox = %sandbox);
    let started = Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    svc.metrics().observe_api(&op, status, started.elapsed());
    span.in_scope(|| {
        tracing::debug!(
            status,
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "handled"
        )
    });
    resp
}

async fn fallback() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint")
}

async fn method_not_allowed(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if resp.status() == StatusCode::METHOD_NOT_ALLOWED {
        let mut r = ApiError::new(
            ErrorCode::InvalidRequest,
            "method not allowed on this endpoint",
        )
        .into_response();
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        return r;
    }
    resp
}

/// The API router over a service.
pub fn router(svc: Arc<Service>) -> Router {
    let limit = svc.config().max_json_body_bytes;
    let id = "/v1/sandboxes/:id";
    Router::new()
        .route("/healthz", get(system::healthz))
        .route("/metrics", get(system::metrics))
        .route("/v1/openapi.json", get(system::openapi))
        .route("/v1/stats", get(system::stats))
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(id, get(sandboxes::get).delete(sandboxes::delete))
        .route(&format!("{id}/exec"), post(sandboxes::exec))
        .route(&format!("{id}/pause"), post(sandboxes::pause))
        .route(&format!("{id}/resume"), post(sandboxes::resume))
        .route(&format!("{id}/hibernate"), post(sandboxes::hibernate))
        .route(&format!("{id}/fork"), post(sandboxes::fork))
        .route(&format!("{id}/rewind"), post(sandboxes::rewind))
        .route(&format!("{id}/events"), get(sandboxes::events))
        .route(
            &format!("{id}/snapshots"),
            post(sandboxes::take_snapshot).get(sandboxes::list_snapshots),
        )
        .route(
            &format!("{id}/files"),
            get(files::download)
                .put(files::upload)
                .delete(files::remove),
        )
        .route(&format!("{id}/files/list"), get(files::list))
        .route(&format!("{id}/files/stat"), get(files::stat))
        .route(&format!("{id}/files/mkdir"), post(files::mkdir))
        .route(
            "/v1/snapshots/:id",
            get(sandboxes::get_snapshot).delete(sandboxes::delete_snapshot),
        )
        .route("/v1/snapshots/:id/fork", post(sandboxes::fork_snapshot))
        .route("/v1/templates", post(templates::build).get(templates::list))
        .route(
            "/v1/templates/:id",
            get(templates::get).delete(templates::delete),
        )
        .fallback(fallback)
        .layer(axum::middleware::from_fn(method_not_allowed))
        .layer(axum::middleware::from_fn_with_state(svc.clone(), track))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(svc)
}

/// `Content-Type` of exec responses.
pub const NDJSON: &str = "application/x-ndjson";

pub(crate) fn ndjson_headers() -> [(header::HeaderName, &'static str); 2] {
    [
        (header::CONTENT_TYPE, NDJSON),
        (header::CACHE_CONTROL, "no-cache"),
    ]
}

#[cfg(test)]
mod tests;
