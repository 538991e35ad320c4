//! The security side of the HTTP API: the `guard` middleware (token →
//! [`Principal`], rate limit, role matrix, tenant isolation, tool-call
//! policy with approvals and audit) and the routes for tokens, policies,
//! approvals, audit and egress.
//!
//! Tenant isolation: a sandbox, snapshot or template id of another tenant
//! answers exactly like an unknown id (`404 not_found`, same message).
//! Templates of tenant `default` (the platform tenant, where the bootstrap
//! admin lives) are shared: every tenant may list and use them; only
//! `default` may delete them.

// The middleware's helpers return the finished `Response` as their error:
// it is built once, on the refusal path, and sent as is.
#![allow(clippy::result_large_err)]

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId, SnapshotId, TemplateId};
use strata_policy::approval::ApprovalError;
use strata_policy::audit::{self, Outcome};
use strata_policy::{CallKind, Decision, Effect, ToolCall};

use super::{query_pairs, ApiError, ApiResult, Body};
use crate::security::auth::{self, Principal, Role};
use crate::security::gate::{GateOptions, GateRefusal};
use crate::security::{self as sec, with_tenant, AuthFailure, Security, GUEST_PROXY};
use crate::service::Service;
use crate::store::DEFAULT_TENANT;

/// Routes of this module (also listed in `api::ROUTES`).
pub const SECURITY_ROUTES: &[(&str, &str)] = &[
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

/// State of the security routes and middleware.
#[derive(Clone)]
pub(crate) struct Ctx {
    svc: Arc<Service>,
    sec: Arc<Security>,
    /// The routes without this middleware: a foreign id is answered by
    /// routing the request again with an id that does not exist.
    inner: Router,
}

/// Puts the security layer around the API router. When the security
/// subsystem failed to open, every `/v1` request answers `500` (fail closed).
pub fn wrap(api: Router, svc: Arc<Service>, security: Result<Arc<Security>, String>) -> Router {
    match security {
        Ok(sec) => {
            let limit = svc.config().max_json_body_bytes;
            let mut ctx = Ctx {
                svc,
                sec,
                inner: Router::new(),
            };
            let inner = api.merge(routes(ctx.clone()).layer(DefaultBodyLimit::max(limit)));
            ctx.inner = inner.clone();
            inner.layer(axum::middleware::from_fn_with_state(ctx, guard))
        }
        Err(msg) => api.layer(axum::middleware::from_fn_with_state(Arc::new(msg), broken)),
    }
}

fn routes(ctx: Ctx) -> Router {
    Router::new()
        .route("/v1/whoami", get(whoami))
        .route("/v1/tokens", post(create_token).get(list_tokens))
        .route("/v1/tokens/:id", axum::routing::delete(revoke_token))
        .route("/v1/policy", get(get_policy).put(put_policy))
        .route("/v1/policy/test", post(test_policy))
        .route(
            "/v1/sandboxes/:id/policy",
            get(get_sandbox_policy).put(put_sandbox_policy),
        )
        .route("/v1/sandboxes/:id/egress", get(egress))
        .route("/v1/approvals", get(list_approvals))
        .route("/v1/approvals/:id", get(get_approval))
        .route("/v1/approvals/:id/approve", post(approve))
        .route("/v1/approvals/:id/deny", post(deny))
        .route("/v1/audit", get(audit_export))
        .route("/v1/audit/verify", get(audit_verify))
        .with_state(ctx)
}

async fn broken(State(msg): State<Arc<String>>, req: Request, next: Next) -> Response {
    if req.uri().path().starts_with("/v1/") {
        return ApiError::new(
            ErrorCode::Internal,
            format!("security subsystem unavailable: {msg}"),
        )
        .into_response();
    }
    next.run(req).await
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Response {
    ApiError::new(code, msg).into_response()
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg)
}

/// Authentication, rate limit, role, tenant isolation, then tool-call policy.
async fn guard(State(ctx): State<Ctx>, mut req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/") {
        // `/healthz` and `/metrics` stay open (see docs/daemon.md).
        return next.run(req).await;
    }
    let header = match req.headers().get(header::AUTHORIZATION) {
        None => None,
        Some(v) => match v.to_str() {
            Ok(s) => Some(s.to_owned()),
            Err(_) => return unauthorized(AuthFailure::Malformed),
        },
    };
    let sec = ctx.sec.clone();
    let p = match tokio::task::spawn_blocking(move || sec.authenticate(header.as_deref())).await {
        Ok(Ok(p)) => p,
        Ok(Err(f)) => return unauthorized(f),
        Err(e) => return err(ErrorCode::Internal, format!("authentication: {e}")),
    };
    if ctx.sec.config().auth {
        if let Err(wait) = ctx.sec.limiter().check(&p.token_id) {
            let mut r = err(
                ErrorCode::RateLimited,
                format!(
                    "rate limit of {} requests/s for this token exceeded",
                    ctx.sec.config().rate_limit_per_second
                ),
            );
            let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            return r;
        }
    }
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let method = req.method().as_str().to_owned();
    if let Some(route) = &route {
        if !auth::allowed(&method, route, p.role) {
            return err(
                ErrorCode::Forbidden,
                format!("role {} may not call {method} {route}", p.role.as_str()),
            );
        }
    }
    req.extensions_mut().insert(p.clone());
    let tenant = p.tenant.clone();
    with_tenant(tenant, async move {
        let req = match route {
            Some(route) => match pre(&ctx, &p, &method, &route, req).await {
                Ok(r) => r,
                Err(resp) => return resp,
            },
            None => req,
        };
        next.run(req).await
    })
    .await
}

fn unauthorized(f: AuthFailure) -> Response {
    let mut r = err(ErrorCode::Unauthorized, f.message());
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"strata\""),
    );
    r
}

fn path_id(path: &str) -> Option<&str> {
    path.split('/').nth(3)
}

/// Options of a gated call, from (and removed from) the query string.
#[derive(Debug, Default)]
struct GateOpts {
    wait: bool,
    timeout: Option<Duration>,
    approval: Option<String>,
}

fn take_gate_opts(req: &mut Request) -> Result<GateOpts, Response> {
    let mut o = GateOpts {
        wait: true,
        ..Default::default()
    };
    let Some(q) = req.uri().query() else {
        return Ok(o);
    };
    let mut rest = form_urlencoded::Serializer::new(String::new());
    let mut changed = false;
    for (k, v) in query_pairs(Some(q)) {
        match k.as_str() {
            "wait" => {
                o.wait = match v.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => {
                        return Err(err(
                            ErrorCode::InvalidRequest,
                            "wait: expected true or false",
                        ))
                    }
                };
                changed = true;
            }
            "approval_timeout" => {
                o.timeout = Some(crate::duration::parse_duration(&v).map_err(|e| {
                    err(ErrorCode::InvalidRequest, format!("approval_timeout: {e}"))
                })?);
                changed = true;
            }
            "approval" => {
                o.approval = Some(v);
                changed = true;
            }
            _ => {
                rest.append_pair(&k, &v);
            }
        }
    }
    if changed {
        let rest = rest.finish();
        let pq = if rest.is_empty() {
            req.uri().path().to_owned()
        } else {
            format!("{}?{rest}", req.uri().path())
        };
        if let Ok(uri) = pq.parse::<Uri>() {
            *req.uri_mut() = uri;
        }
    }
    Ok(o)
}

async fn buffer(ctx: &Ctx, req: Request) -> Result<(Request, Bytes), Response> {
    let limit = ctx.svc.config().max_json_body_bytes;
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        err(
            ErrorCode::PayloadTooLarge,
            "request body is larger than the limit",
        )
    })?;
    Ok((
        Request::from_parts(parts, axum::body::Body::from(bytes.clone())),
        bytes,
    ))
}

/// Answers a request about another tenant's resource exactly as the same
/// request about an unknown id: it is routed again with a fresh (unknown)
/// id in place of the foreign one, and the id is put back in the answer.
async fn as_unknown(ctx: &Ctx, req: Request, real: &str, fake: &str) -> Response {
    use tower::ServiceExt as _;
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map(|x| x.as_str().replacen(real, fake, 1))
        .unwrap_or_default();
    match pq.parse::<Uri>() {
        Ok(u) => parts.uri = u,
        Err(_) => return err(ErrorCode::NotFound, format!("{real} not found")),
    }
    // A fresh request: the first routing's path parameters must not stay.
    let mut fresh = Request::new(body);
    *fresh.method_mut() = parts.method;
    *fresh.uri_mut() = parts.uri;
    *fresh.headers_mut() = parts.headers;
    if let Some(p) = parts.extensions.get::<Principal>() {
        fresh.extensions_mut().insert(p.clone());
    }
    let resp = match ctx.inner.clone().oneshot(fresh).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes).replace(fake, real);
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(text))
}

/// Tenant isolation of ids in the path, then the policy gate.
async fn pre(
    ctx: &Ctx,
    p: &Principal,
    method: &str,
    route: &str,
    mut req: Request,
) -> Result<Request, Response> {
    let raw_id = path_id(req.uri().path()).unwrap_or("").to_owned();
    // Which sandbox the call is about, once its ownership is checked.
    let mut sandbox: Option<String> = None;
    if route.starts_with("/v1/sandboxes/:id") {
        let Ok(id) = raw_id.parse::<SandboxId>() else {
            return Ok(req);
        };
        match ctx.svc.get_sandbox(&id).await {
            Ok(rec) if rec.tenant != p.tenant => {
                return Err(as_unknown(ctx, req, &raw_id, SandboxId::generate().as_ref()).await)
            }
            Ok(_) => sandbox = Some(id.to_string()),
            // Unknown: the handler answers 404 itself, no tool call happens.
            Err(_) => return Ok(req),
        }
    } else if route.starts_with("/v1/snapshots/:id") {
        let Ok(id) = raw_id.parse::<SnapshotId>() else {
            return Ok(req);
        };
        match ctx.svc.get_snapshot(&id).await {
            Ok(s) if s.tenant != p.tenant => {
                return Err(as_unknown(ctx, req, &raw_id, SnapshotId::generate().as_ref()).await)
            }
            Ok(s) => sandbox = Some(s.sandbox_id.to_string()),
            Err(_) => return Ok(req),
        }
    } else if route.starts_with("/v1/templates/:id") {
        let Ok(id) = raw_id.parse::<TemplateId>() else {
            return Ok(req);
        };
        if let Ok(t) = ctx.svc.get_template(&id).await {
            let owner = t.record.tenant;
            if owner != p.tenant && owner != DEFAULT_TENANT {
                return Err(as_unknown(ctx, req, &raw_id, TemplateId::generate().as_ref()).await);
            }
            if method == "DELETE" && owner != p.tenant {
                return Err(err(
                    ErrorCode::Forbidden,
                    format!("template {raw_id} is shared by the platform; only its tenant may delete it"),
                ));
            }
        }
    }
    let lifecycle = |op: &str| Some(CallKind::Lifecycle { op: op.to_owned() });
    let file_path = |req: &Request| {
        query_pairs(req.uri().query())
            .into_iter()
            .find(|(k, _)| k == "path")
            .map(|(_, v)| v)
    };
    let kind: Option<CallKind> = match (method, route) {
        ("POST", "/v1/sandboxes") => {
            let (r, bytes) = buffer(ctx, req).await?;
            req = r;
            #[derive(Deserialize)]
            struct Peek {
                #[serde(default)]
                template: Option<String>,
            }
            if let Ok(Peek { template: Some(t) }) = serde_json::from_slice::<Peek>(&bytes) {
                if let Ok(tid) = t.parse::<TemplateId>() {
                    if let Ok(v) = ctx.svc.get_template(&tid).await {
                        if !sec::template_visible(&v.record.tenant) {
                            return Err(err(
                                ErrorCode::NotFound,
                                format!("template {t} not found"),
                            ));
                        }
                    }
                }
            }
            lifecycle("create")
        }
        ("POST", "/v1/templates") => lifecycle("build_template"),
        ("DELETE", "/v1/templates/:id") => lifecycle("delete_template"),
        _ if sandbox.is_none() => None,
        ("POST", "/v1/sandboxes/:id/exec") => {
            let (r, bytes) = buffer(ctx, req).await?;
            req = r;
            #[derive(Deserialize)]
            struct Peek {
                cmd: Vec<String>,
            }
            let peek: Peek = serde_json::from_slice(&bytes)
                .map_err(|e| err(ErrorCode::InvalidRequest, format!("invalid JSON body: {e}")))?;
            Some(CallKind::Exec {
                argv: peek.cmd,
                shell: None,
            })
        }
        ("GET", "/v1/sandboxes/:id/files")
        | ("GET", "/v1/sandboxes/:id/files/list")
        | ("GET", "/v1/sandboxes/:id/files/stat") => {
            file_path(&req).map(|path| CallKind::FileRead { path })
        }
        ("PUT", "/v1/sandboxes/:id/files")
        | ("DELETE", "/v1/sandboxes/:id/files")
        | ("POST", "/v1/sandboxes/:id/files/mkdir") => {
            file_path(&req).map(|path| CallKind::FileWrite { path })
        }
        ("POST", "/v1/sandboxes/:id/snapshots") => Some(CallKind::Snapshot),
        ("POST", "/v1/sandboxes/:id/fork") | ("POST", "/v1/snapshots/:id/fork") => {
            Some(CallKind::Fork)
        }
        ("POST", "/v1/sandboxes/:id/rewind") => {
            let (r, bytes) = buffer(ctx, req).await?;
            req = r;
            #[derive(Deserialize)]
            struct Peek {
                #[serde(default)]
                to: Option<String>,
            }
            if let Ok(Peek { to: Some(to) }) = serde_json::from_slice::<Peek>(&bytes) {
                if let Ok(sid) = to.parse::<SnapshotId>() {
                    if let Ok(s) = ctx.svc.get_snapshot(&sid).await {
                        if s.tenant != p.tenant {
                            return Err(err(
                                ErrorCode::NotFound,
                                format!("snapshot {to} not found"),
                            ));
                        }
                    }
                }
            }
            Some(CallKind::Rewind)
        }
        ("POST", "/v1/sandboxes/:id/pause") => lifecycle("pause"),
        ("POST", "/v1/sandboxes/:id/resume") => lifecycle("resume"),
        ("POST", "/v1/sandboxes/:id/hibernate") => lifecycle("hibernate"),
        ("DELETE", "/v1/sandboxes/:id") => lifecycle("delete"),
        ("DELETE", "/v1/snapshots/:id") => lifecycle("delete_snapshot"),
        _ => None,
    };
    let Some(kind) = kind else {
        return Ok(req);
    };
    let opts = take_gate_opts(&mut req)?;
    let call = ToolCall {
        tenant: p.tenant.clone(),
        sandbox,
        actor: p.actor(),
        kind,
    };
    gate(ctx, call, opts).await?;
    Ok(req)
}

fn decision_body(d: &Decision, approval_id: Option<&str>, msg: String) -> serde_json::Value {
    json!({ "error": {
        "code": ErrorCode::PolicyDenied,
        "message": msg,
        "rule": d.rule_id,
        "layer": d.layer,
        "reason": d.reason,
        "approval_id": approval_id,
    }})
}

fn denied(d: &Decision, approval_id: Option<&str>, msg: String) -> Response {
    (
        StatusCode::FORBIDDEN,
        Json(decision_body(d, approval_id, msg)),
    )
        .into_response()
}

/// Decides a tool call through the shared gate ([`Security::gate`]): allow
/// → `Ok`; deny → 403; approve → hold it and wait (or 202 with
/// `wait=false`); a re-submission with `approval=<id>` runs once if that
/// request was approved for the same call.
async fn gate(ctx: &Ctx, call: ToolCall, opts: GateOpts) -> Result<(), Response> {
    let opts = GateOptions {
        wait: opts.wait,
        timeout: opts.timeout,
        approval: opts.approval,
    };
    match ctx.sec.gate(call, opts).await {
        Ok(()) => Ok(()),
        Err(GateRefusal::Invalid(m)) => Err(err(ErrorCode::InvalidRequest, m)),
        Err(GateRefusal::Denied {
            decision,
            approval_id,
            message,
        }) => Err(denied(&decision, approval_id.as_deref(), message)),
        Err(GateRefusal::Pending(req)) => Err((
            StatusCode::ACCEPTED,
            Json(json!({
                "status": "pending",
                "poll": format!("/v1/approvals/{}", req.id),
                "resubmit_with": format!("approval={}", req.id),
                "approval": req,
            })),
        )
            .into_response()),
        Err(GateRefusal::Internal(m)) => Err(err(ErrorCode::Internal, m)),
    }
}

// ---------------------------------------------------------------- handlers

async fn whoami(Extension(p): Extension<Principal>) -> impl IntoResponse {
    Json(json!({
        "token_id": p.token_id,
        "tenant": p.tenant,
        "role": p.role,
        "name": p.name,
    }))
}

/// `POST /v1/tokens` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateToken {
    #[serde(default)]
    role: Option<Role>,
    #[serde(default)]
    name: Option<String>,
    /// Another tenant (only admins of tenant `default`, the platform tenant).
    #[serde(default)]
    tenant: Option<String>,
    /// Lifetime, e.g. `"30d"`.
    #[serde(default)]
    expires_in: Option<String>,
}

fn valid_tenant(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 63
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn target_tenant(p: &Principal, asked: Option<String>) -> ApiResult<String> {
    match asked {
        None => Ok(p.tenant.clone()),
        Some(t) if t == p.tenant => Ok(t),
        Some(t) => {
            if p.tenant != DEFAULT_TENANT {
                return Err(ApiError::new(
                    ErrorCode::Forbidden,
                    "only admins of the platform tenant `default` act on other tenants",
                ));
            }
            if !valid_tenant(&t) {
                return Err(invalid(format!("tenant {t:?}: 1-63 of [a-z0-9-_]")));
            }
            Ok(t)
        }
    }
}

async fn create_token(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Body(b): Body<CreateToken>,
) -> ApiResult<impl IntoResponse> {
    let role = b
        .role
        .ok_or_else(|| invalid("role: required (admin, developer, approver, viewer)"))?;
    let tenant = target_tenant(&p, b.tenant)?;
    if b.name.as_ref().is_some_and(|n| n.len() > 128) {
        return Err(invalid("name: at most 128 bytes"));
    }
    let expires_at = match &b.expires_in {
        None => None,
        Some(s) => {
            let d = crate::duration::parse_duration(s)
                .map_err(|e| invalid(format!("expires_in: {e}")))?;
            let d =
                chrono::Duration::from_std(d).map_err(|e| invalid(format!("expires_in: {e}")))?;
            Some(Utc::now() + d)
        }
    };
    let sec = ctx.sec.clone();
    let by = p.token_id.clone();
    let issued = tokio::task::spawn_blocking(move || {
        sec.issue_token(&tenant, role, b.name, expires_at, &by)
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok((StatusCode::CREATED, Json(issued)))
}

fn tenant_param(p: &Principal, q: Option<&str>) -> ApiResult<String> {
    let mut asked = None;
    for (k, v) in query_pairs(q) {
        match k.as_str() {
            "tenant" => asked = Some(v),
            other => return Err(invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    target_tenant(p, asked)
}

async fn list_tokens(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let tenant = tenant_param(&p, q.as_deref())?;
    let store = ctx.sec.store().clone();
    let items = tokio::task::spawn_blocking(move || store.tokens(&tenant))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Json(json!({ "items": items })))
}

async fn revoke_token(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let tenant = tenant_param(&p, q.as_deref())?;
    let store = ctx.sec.store().clone();
    let id2 = id.clone();
    let rec = tokio::task::spawn_blocking(move || {
        if store.revoke_token(&tenant, &id2, Utc::now())? {
            store.token(&tenant, &id2)
        } else {
            Ok(None)
        }
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    rec.map(Json)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("token {id} not found")))
}

fn policy_text(body: Bytes) -> ApiResult<String> {
    String::from_utf8(body.to_vec()).map_err(|_| invalid("policy: not UTF-8"))
}

async fn get_policy(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
) -> ApiResult<impl IntoResponse> {
    let store = ctx.sec.store().clone();
    let t = p.tenant.clone();
    let text = tokio::task::spawn_blocking(move || store.tenant_policy(&t))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Json(json!({ "tenant": p.tenant, "toml": text })))
}

async fn put_policy(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    body: Bytes,
) -> ApiResult<impl IntoResponse> {
    let text = policy_text(body)?;
    let sec = ctx.sec.clone();
    let (t, by) = (p.tenant.clone(), p.token_id.clone());
    tokio::task::spawn_blocking(move || sec.policies().put_tenant(&t, &text, &by))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(invalid)?;
    Ok(Json(json!({ "tenant": p.tenant, "updated": true })))
}

async fn get_sandbox_policy(
    State(ctx): State<Ctx>,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    let sid: SandboxId = super::parse_id(&id)?;
    ctx.svc.get_sandbox(&sid).await?;
    let store = ctx.sec.store().clone();
    let text = tokio::task::spawn_blocking(move || store.sandbox_policy(&id))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Json(json!({ "sandbox": sid, "toml": text })))
}

async fn put_sandbox_policy(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<impl IntoResponse> {
    let sid: SandboxId = super::parse_id(&id)?;
    ctx.svc.get_sandbox(&sid).await?;
    let text = policy_text(body)?;
    let sec = ctx.sec.clone();
    let (t, by) = (p.tenant.clone(), p.token_id.clone());
    tokio::task::spawn_blocking(move || sec.policies().put_sandbox(&t, &id, &text, &by))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(invalid)?;
    Ok(Json(json!({ "sandbox": sid, "updated": true })))
}

/// `POST /v1/policy/test` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TestCall {
    #[serde(default)]
    sandbox: Option<String>,
    call: CallKind,
}

impl Default for TestCall {
    fn default() -> Self {
        TestCall {
            sandbox: None,
            call: CallKind::Snapshot,
        }
    }
}

async fn test_policy(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Body(b): Body<TestCall>,
) -> ApiResult<impl IntoResponse> {
    if let Some(s) = &b.sandbox {
        let sid: SandboxId = super::parse_id(s)?;
        let rec = ctx.svc.get_sandbox(&sid).await?;
        if rec.tenant != p.tenant {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("sandbox {s} not found"),
            ));
        }
    }
    let call = ToolCall {
        tenant: p.tenant.clone(),
        sandbox: b.sandbox,
        actor: p.actor(),
        kind: b.call,
    };
    let sec = ctx.sec.clone();
    let d = tokio::task::spawn_blocking(move || sec.evaluate(&call))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Json(d))
}

async fn egress(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    let sid: SandboxId = super::parse_id(&id)?;
    ctx.svc.get_sandbox(&sid).await?;
    let addr = ctx
        .sec
        .egress_proxy(&p.tenant, &id)
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("egress proxy: {e}")))?;
    Ok(Json(json!({
        "sandbox": sid,
        "proxy": addr.to_string(),
        "guest_proxy": format!("http://{GUEST_PROXY}"),
    })))
}

async fn list_approvals(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let mut pending = true;
    for (k, v) in query_pairs(q.as_deref()) {
        match (k.as_str(), v.as_str()) {
            ("status", "pending") => pending = true,
            ("status", "all") => pending = false,
            ("status", other) => {
                return Err(invalid(format!(
                    "status {other:?}: expected pending or all"
                )))
            }
            (other, _) => return Err(invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    Ok(Json(
        json!({ "items": ctx.sec.approvals().list(&p.tenant, pending) }),
    ))
}

fn approval_error(id: &str, e: ApprovalError) -> ApiError {
    match e {
        ApprovalError::NotFound => {
            ApiError::new(ErrorCode::NotFound, format!("approval {id} not found"))
        }
        ApprovalError::AlreadyAnswered { status } => ApiError::new(
            ErrorCode::Conflict,
            format!(
                "approval {id} was answered already ({})",
                serde_json::to_value(&status)
                    .ok()
                    .and_then(|v| v["status"].as_str().map(String::from))
                    .unwrap_or_default()
            ),
        ),
        ApprovalError::SelfApproval => ApiError::new(
            ErrorCode::Forbidden,
            "the requester cannot answer their own request",
        ),
        ApprovalError::Store(e) => ApiError::new(ErrorCode::Internal, e.to_string()),
    }
}

async fn get_approval(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    ctx.sec
        .approvals()
        .get(&p.tenant, &id)
        .map(Json)
        .map_err(|e| approval_error(&id, e))
}

async fn answer(ctx: Ctx, p: Principal, id: String, approve: bool) -> ApiResult<Response> {
    // With authentication off there is one anonymous caller; let it answer
    // its own requests (local development).
    let who = if p.token_id == "anonymous" {
        "anonymous-approver".to_owned()
    } else {
        p.actor()
    };
    let q = ctx.sec.approvals().clone();
    let (t, id2, who2) = (p.tenant.clone(), id.clone(), who.clone());
    let r = tokio::task::spawn_blocking(move || q.answer(&t, &id2, &who2, approve))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| approval_error(&id, e))?;
    let d = Decision {
        effect: Effect::Approve,
        layer: None,
        rule_id: r.rule_id.clone(),
        rule_index: None,
        hard: false,
        reason: r.reason.clone(),
    };
    let outcome = if approve {
        Outcome::Approved
    } else {
        Outcome::Rejected
    };
    let (sec, call, rid) = (ctx.sec.clone(), r.call.clone(), r.id.clone());
    tokio::task::spawn_blocking(move || sec.record(&call, &d, outcome, Some(rid), Some(who)))
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "audit log write failed"))?;
    Ok(Json(r).into_response())
}

async fn approve(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    answer(ctx, p, id, true).await
}

async fn deny(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    answer(ctx, p, id, false).await
}

async fn audit_export(
    State(ctx): State<Ctx>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let mut filter = audit::Filter {
        tenant: Some(p.tenant.clone()),
        sandbox: None,
    };
    let mut since: Option<DateTime<Utc>> = None;
    for (k, v) in query_pairs(q.as_deref()) {
        match k.as_str() {
            "sandbox" => filter.sandbox = Some(v),
            "since" => {
                since = Some(match DateTime::parse_from_rfc3339(&v) {
                    Ok(t) => t.with_timezone(&Utc),
                    Err(_) => {
                        let d = crate::duration::parse_duration(&v).map_err(|_| {
                            invalid(format!(
                                "since {v:?}: expected RFC 3339 time or a duration like 10m"
                            ))
                        })?;
                        Utc::now()
                            - chrono::Duration::from_std(d)
                                .map_err(|e| invalid(format!("since: {e}")))?
                    }
                })
            }
            other => return Err(invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    let path = ctx.sec.audit_path().to_owned();
    let out = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, audit::AuditError> {
        let mut buf = Vec::new();
        audit::export(&path, &filter, &mut buf)?;
        let Some(since) = since else { return Ok(buf) };
        let mut kept = Vec::new();
        for line in buf.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let t = serde_json::from_slice::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["time"].as_str().map(String::from))
                .and_then(|s| DateTime::parse_from_rfc3339(&s).ok());
            if t.is_some_and(|t| t >= since) {
                kept.extend_from_slice(line);
                kept.push(b'\n');
            }
        }
        Ok(kept)
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, super::NDJSON)], out))
}

async fn audit_verify(State(ctx): State<Ctx>) -> ApiResult<impl IntoResponse> {
    let sec = ctx.sec.clone();
    let r = tokio::task::spawn_blocking(move || sec.verify_audit())
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Json(match r {
        Ok(v) => json!({ "ok": true, "entries": v.entries, "head": v.head }),
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    }))
}
