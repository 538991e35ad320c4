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

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, MatchedPath, Request, State};
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

use crate::security::gate::GateOptions;
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

/// An API error: a stable code, its HTTP status and a message (and, for
/// a policy decision, the decision's details; for a call held for approval,
/// the `202` answer that says how to poll and re-send).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// Human message.
    pub message: String,
    /// A status and body other than `{error:{code,message}}` at the code's status.
    custom: Option<(u16, serde_json::Value)>,
}

impl ApiError {
    /// An error with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            custom: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match &self.custom {
            Some((_, b)) => b.clone(),
            None => json!({ "error": { "code": self.code, "message": self.message } }),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        self.custom
            .as_ref()
            .map(|(s, _)| *s)
            .unwrap_or(self.code.http_status())
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        use crate::security::gate::GateRefusal;
        if matches!(e.code(), ErrorCode::Internal) {
            tracing::error!(error = %e.message(), "internal error");
        }
        let mut out = ApiError::new(e.code(), e.message());
        match e {
            ServiceError::Gate(GateRefusal::Denied {
                decision,
                approval_id,
                message,
            }) => {
                out.custom = Some((
                    403,
                    json!({ "error": {
                        "code": ErrorCode::PolicyDenied,
                        "message": message,
                        "rule": decision.rule_id,
                        "layer": decision.layer,
                        "reason": decision.reason,
                        "approval_id": approval_id,
                    }}),
                ));
            }
            ServiceError::Gate(GateRefusal::Pending(req)) => {
                out.custom = Some((
                    202,
                    json!({
                        "status": "pending",
                        "poll": format!("/v1/approvals/{}", req.id),
                        "resubmit_with": format!("approval={}", req.id),
                        "approval": req,
                    }),
                ));
            }
            _ => {}
        }
        out
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
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

/// The query of one request, parsed once: every key must be one the route
/// takes, and only the keys it lets repeat may appear twice (`400
/// invalid_request` otherwise), so what a check reads and what the action
/// uses are the same value.
#[derive(Debug, Default)]
pub(crate) struct Params {
    pairs: Vec<(String, String)>,
}

/// Query keys of every gated call: how a held call waits (see
/// [`Params::gate_options`]).
pub(crate) const GATE_KEYS: &[&str] = &["wait", "approval_timeout", "approval"];

impl Params {
    /// Parses `raw`: keys outside `allowed` (and, on gated routes,
    /// [`GATE_KEYS`]) are refused, and so is a second value of a key not in
    /// `repeatable`.
    pub(crate) fn parse(
        raw: Option<&str>,
        allowed: &[&str],
        repeatable: &[&str],
        gated: bool,
    ) -> ApiResult<Params> {
        let mut pairs: Vec<(String, String)> = Vec::new();
        for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            let k = k.into_owned();
            let known = allowed.contains(&k.as_str()) || (gated && GATE_KEYS.contains(&k.as_str()));
            if !known {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("unknown query parameter {k:?}"),
                ));
            }
            if !repeatable.contains(&k.as_str()) && pairs.iter().any(|(pk, _)| *pk == k) {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("query parameter {k:?} given more than once"),
                ));
            }
            pairs.push((k, v.into_owned()));
        }
        Ok(Params { pairs })
    }

    /// The value of a key given at most once.
    pub(crate) fn one(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of a repeatable key, in order.
    pub(crate) fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.pairs
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// How a held call is handled: `wait` (default true), `approval_timeout`,
    /// `approval` (the id of an approval granted for this same call).
    pub(crate) fn gate_options(&self) -> ApiResult<GateOptions> {
        let wait = match self.one("wait") {
            None | Some("true" | "1" | "") => true,
            Some("false" | "0") => false,
            Some(_) => {
                return Err(ApiError::new(
                    ErrorCode::InvalidRequest,
                    "wait: expected true or false",
                ))
            }
        };
        let timeout = self
            .one("approval_timeout")
            .map(crate::duration::parse_duration)
            .transpose()
            .map_err(|e| {
                ApiError::new(ErrorCode::InvalidRequest, format!("approval_timeout: {e}"))
            })?;
        Ok(GateOptions {
            wait,
            timeout,
            approval: self.one("approval").map(str::to_owned),
        })
    }
}

/// The query of a gated route that takes no other parameter.
pub(crate) fn gate_only(raw: Option<&str>) -> ApiResult<GateOptions> {
    Params::parse(raw, &[], &[], true)?.gate_options()
}

/// The `:id` path parameter as the router decoded it; a parameter that does
/// not decode (`%ZZ`, invalid UTF-8) is `400 invalid_request` in the API's
/// error shape.
#[derive(Debug)]
pub(crate) struct PathId(pub(crate) String);

#[axum::async_trait]
impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(s)| PathId(s))
            .map_err(|e| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("path: {}", e.body_text()),
                )
            })
    }
}

/// A parsed id from the path (malformed: `400 invalid_request`).
pub(crate) fn parse_id<T: std::str::FromStr>(s: &str) -> ApiResult<T>
where
    T::Err: std::fmt::Display,
{
    s.parse()
        .map_err(|e: T::Err| ApiError::new(ErrorCode::InvalidRequest, e.to_string()))
}

/// Records latency per operation and puts the (decoded) id on the request's span.
async fn track(State(svc): State<Arc<Service>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let op = format!("{} {}", req.method(), route);
    // The id as the handler sees it (decoded by the router), for logs only.
    let (mut parts, body) = req.into_parts();
    let id = axum::extract::RawPathParams::from_request_parts(&mut parts, &())
        .await
        .ok()
        .and_then(|p| {
            p.iter()
                .find(|(k, _)| *k == "id")
                .map(|(_, v)| v.escape_debug().to_string())
        })
        .unwrap_or_default();
    let req = Request::from_parts(parts, body);
    // The caller's tenant (the security layer runs first), so latencies are
    // also kept per tenant for its `/v1/stats`.
    let tenant = req
        .extensions()
        .get::<crate::caller::Caller>()
        .and_then(|c| c.tenant().map(str::to_owned));
    let span = tracing::info_span!("request", op = %op, id = %id);
    let started = Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    svc.metrics()
        .observe_api(&op, status, started.elapsed(), tenant.as_deref());
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
