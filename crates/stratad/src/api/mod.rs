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
use axum::{Json, Router};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde_json::json;
use strata_core::ErrorCode;
use tracing::Instrument;

use crate::security::gate::GateOptions;
use crate::service::{Service, ServiceError};

mod code;
mod events;
mod files;
pub mod forward;
mod interactive;
mod metrics;
pub mod ports;
pub mod routes;
mod sandboxes;
pub mod security;
mod system;
mod templates;
mod terminal;
mod transfer;

/// The OpenAPI document (checked in, served at `/v1/openapi.json`).
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");

pub use routes::{Action, Route, ROUTES};

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
                // Too many pending requests on the sandbox: retry later.
                let (status, code) = if crate::security::gate::is_approval_limit(&decision) {
                    (429, ErrorCode::RateLimited)
                } else {
                    (403, ErrorCode::PolicyDenied)
                };
                out.custom = Some((
                    status,
                    json!({ "error": {
                        "code": code,
                        "message": message,
                        "rule": decision.rule_id,
                        "layer": decision.layer,
                        "reason": decision.reason,
                        "approval_id": approval_id,
                    }}),
                ));
            }
            ServiceError::VariantBuilding(v) => {
                out.custom = Some((
                    202,
                    json!({
                        "status": "building",
                        "message": out.message,
                        "poll": format!("/v1/templates/{}", v.record.id),
                        "retry_after_s": 2,
                        "variant": v,
                    }),
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
        // Every body of this API is an object. serde's derived structs
        // also read a JSON array, field by field in order (`[null, null]`
        // was a template build): anything but an object is refused.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "invalid JSON body: expected an object",
            ));
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

    /// A boolean parameter: `true`/`1` or `false`/`0`, `default` when
    /// absent. Anything else, the empty value (`?wait=`, `?wait`) included,
    /// is `400 invalid_request`: a flag is never read from a value the
    /// OpenAPI document would not allow.
    pub(crate) fn flag(&self, key: &str, default: bool) -> ApiResult<bool> {
        parse_flag(key, self.one(key), default)
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
        let wait = self.flag("wait", true)?;
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
            body: None,
        })
    }
}

/// A boolean query value (see [`Params::flag`]).
pub(crate) fn parse_flag(key: &str, value: Option<&str>, default: bool) -> ApiResult<bool> {
    match value {
        None => Ok(default),
        Some("true" | "1") => Ok(true),
        Some("false" | "0") => Ok(false),
        Some(_) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("{key}: expected true or false"),
        )),
    }
}

/// The query of a gated route that takes no other parameter.
pub(crate) fn gate_only(raw: Option<&str>) -> ApiResult<GateOptions> {
    Params::parse(raw, &[], &[], true)?.gate_options()
}

/// What a handler needs from the request parts: the service, the caller
/// (from the security layer), the decoded `:id` (when the route has one)
/// and the raw query, parsed by the handler once.
pub(crate) struct Call {
    pub(crate) svc: Arc<Service>,
    pub(crate) caller: crate::caller::Caller,
    id: Option<String>,
    query: Option<String>,
}

#[axum::async_trait]
impl<S> FromRequestParts<S> for Call
where
    S: Send + Sync,
    Arc<Service>: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        use axum::extract::FromRef;
        let caller = parts
            .extensions
            .get::<crate::caller::Caller>()
            .cloned()
            .ok_or_else(|| {
                ApiError::new(ErrorCode::Internal, "no caller: security layer missing")
            })?;
        let has_id = parts
            .extensions
            .get::<MatchedPath>()
            .is_some_and(|m| m.as_str().contains(":id"));
        let id = if has_id {
            Some(PathId::from_request_parts(parts, state).await?.0)
        } else {
            None
        };
        Ok(Call {
            svc: Arc::<Service>::from_ref(state),
            caller,
            id,
            query: parts.uri.query().map(str::to_owned),
        })
    }
}

impl Call {
    /// The `:id`, parsed (`400 invalid_request` when malformed).
    pub(crate) fn id<T: std::str::FromStr>(&self) -> ApiResult<T>
    where
        T::Err: std::fmt::Display,
    {
        parse_id(self.id.as_deref().unwrap_or(""))
    }

    /// The caller, the `:id` as the router decoded it (opaque ids:
    /// approvals, tokens) and the raw query.
    pub(crate) fn into_parts(self) -> (crate::caller::Caller, String, Option<String>) {
        (self.caller, self.id.unwrap_or_default(), self.query)
    }

    /// The query of a gated route that takes no other parameter.
    pub(crate) fn gate(&self) -> ApiResult<GateOptions> {
        gate_only(self.query.as_deref())
    }

    /// The query, parsed once with the route's keys.
    pub(crate) fn params(
        &self,
        allowed: &[&str],
        repeatable: &[&str],
        gated: bool,
    ) -> ApiResult<Params> {
        Params::parse(self.query.as_deref(), allowed, repeatable, gated)
    }

    /// The `:id` as the router decoded it (opaque ids).
    pub(crate) fn raw_id(&self) -> &str {
        self.id.as_deref().unwrap_or("")
    }

    /// The raw query.
    pub(crate) fn query(&self) -> Option<&str> {
        self.query.as_deref()
    }

    /// Refuses any query parameter (a route that takes none).
    pub(crate) fn no_query(&self) -> ApiResult<()> {
        self.params(&[], &[], false).map(|_| ())
    }
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
    let op = routes::find(req.method().as_str(), &route)
        .map(Route::label)
        .unwrap_or_else(|| format!("{} {route}", req.method()));
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

/// A method router for `method` (`GET` also answers `HEAD`).
pub(crate) fn on<H, T, S>(method: &str, handler: H) -> axum::routing::MethodRouter<S>
where
    H: axum::handler::Handler<T, S>,
    T: 'static,
    S: Clone + Send + Sync + 'static,
{
    use axum::routing::MethodFilter;
    let filter = match method {
        "POST" => MethodFilter::POST,
        "PUT" => MethodFilter::PUT,
        "DELETE" => MethodFilter::DELETE,
        "PATCH" => MethodFilter::PATCH,
        _ => MethodFilter::GET,
    };
    axum::routing::on(filter, handler)
}

/// The handler of a route served over the service (`None`: a route of the
/// security layer, [`security::wrap`]).
fn service_route(r: &Route) -> Option<axum::routing::MethodRouter<Arc<Service>>> {
    use Action::*;
    let m = r.method;
    Some(match r.action {
        Healthz => on(m, system::healthz),
        Livez => on(m, system::livez),
        Metrics => on(m, system::metrics),
        OpenApi => on(m, system::openapi),
        Ca => on(m, system::ca),
        Stats => on(m, system::stats),
        CreateSandbox => on(m, sandboxes::create),
        ListSandboxes => on(m, sandboxes::list),
        GetSandbox => on(m, sandboxes::get),
        DeleteSandbox => on(m, sandboxes::delete),
        Exec => on(m, sandboxes::exec),
        TerminalTicket => on(m, terminal::ticket),
        Terminal => on(m, terminal::open),
        RunCode => on(m, code::run_code),
        Pause => on(m, sandboxes::pause),
        Resume => on(m, sandboxes::resume),
        Hibernate => on(m, sandboxes::hibernate),
        Fork => on(m, sandboxes::fork),
        Rewind => on(m, sandboxes::rewind),
        Events => on(m, events::sandbox_events),
        EventStream => on(m, events::stream),
        CreateWebhook => on(m, events::create_webhook),
        ListWebhooks => on(m, events::list_webhooks),
        DeleteWebhook => on(m, events::delete_webhook),
        WebhookDeliveries => on(m, events::webhook_deliveries),
        SandboxMetrics => on(m, metrics::sandbox_metrics),
        SandboxLogs => on(m, metrics::sandbox_logs),
        Port => on(m, ports::proxy),
        TakeSnapshot => on(m, sandboxes::take_snapshot),
        ListSnapshots => on(m, sandboxes::list_snapshots),
        ReadFile => on(m, files::download),
        WriteFile => on(m, files::upload),
        RemoveFile => on(m, files::remove),
        ListDir => on(m, files::list),
        StatFile => on(m, files::stat),
        MakeDir => on(m, files::mkdir),
        GetSnapshot => on(m, sandboxes::get_snapshot),
        DeleteSnapshot => on(m, sandboxes::delete_snapshot),
        ForkSnapshot => on(m, sandboxes::fork_snapshot),
        BuildTemplate => on(m, templates::build),
        ListTemplates => on(m, templates::list),
        GetTemplate => on(m, templates::get),
        DeleteTemplate => on(m, templates::delete),
        TemplateLogs => on(m, templates::logs),
        BuildVariant => on(m, templates::build_variant),
        ListVariants => on(m, templates::list_variants),
        StreamTemplate => on(m, templates::stream),
        ReplicateTemplate => on(m, templates::replicate),
        PutTemplateFile => on(m, templates::put_file),
        GetTemplateFile => on(m, templates::get_file),
        Push => on(m, transfer::push),
        ImportOffer => on(m, transfer::offer),
        ImportSnapshot => on(m, transfer::receive),
        ImportRegister => on(m, transfer::register),
        Pull => on(m, transfer::pull),
        Export => on(m, transfer::export),
        ExportSnapshot => on(m, transfer::export_snapshot),
        Move => on(m, transfer::move_sandbox),
        ImportAdopt => on(m, transfer::adopt),
        PatchSandbox => on(m, sandboxes::patch),
        GetSettings => on(m, sandboxes::get_settings),
        PutSettings => on(m, sandboxes::put_settings),
        ReplicaOffer => on(m, transfer::replica_offer),
        ReplicaSnapshot => on(m, transfer::replica_receive),
        _ => return None,
    })
}

/// The API router over a service: every route of [`ROUTES`] the service
/// serves (the security layer adds its own and the authentication).
pub fn router(svc: Arc<Service>) -> Router {
    let limit = svc.config().max_json_body_bytes;
    let mut router = Router::new();
    for r in ROUTES {
        if let Some(mr) = service_route(r) {
            router = router.route(r.path, mr);
        }
    }
    router
        .fallback(fallback)
        .layer(axum::middleware::from_fn(method_not_allowed))
        .layer(axum::middleware::from_fn_with_state(svc.clone(), track))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            svc.clone(),
            forward::layer,
        ))
        .with_state(svc)
}

/// Whether a request declares a body (`Content-Length`) larger than
/// `limit`: refused before anything is read (a chunked body is counted as
/// it streams by the handler).
pub(crate) fn declares_more_than(headers: &axum::http::HeaderMap, limit: u64) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > limit)
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
