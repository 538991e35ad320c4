//! The security side of the HTTP API: the `authenticate` middleware (token →
//! [`Caller`], rate limit, the role of the route) and the routes for tokens,
//! policies, approvals, audit and egress.
//!
//! This layer decides *who* calls and whether their role may call the
//! route, nothing else. Tenant isolation and the tool-call policy are
//! decided by the service command the handler calls, with the caller and
//! the values the action will use (decoded path parameters, the one parsed
//! query, the parsed body): a sandbox, snapshot or template id of another
//! tenant answers exactly like an unknown id (`404 not_found`, same
//! message), whatever way the id was spelled in the URL.
//!
//! Templates of the platform scope (the default template) are shared by
//! every tenant and deleted or taken over by none.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, RawQuery, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId};
use strata_policy::approval::ApprovalError;
use strata_policy::audit::{self, Outcome};
use strata_policy::policy::HostPattern;
use strata_policy::{CallKind, Decision, Effect, ToolCall};

use super::routes::{self, Access, Action, Route, ROUTES};
use super::{on, ApiError, ApiResult, Body, Call, Params};
use crate::caller::Caller;
use crate::security::auth::Role;
use crate::security::{AuthFailure, Security, GUEST_PROXY};
use crate::service::Service;
use crate::store::DEFAULT_TENANT;

/// State of the security routes and middleware.
#[derive(Clone)]
pub(crate) struct Ctx {
    svc: Arc<Service>,
    sec: Arc<Security>,
}

/// Puts the security layer around the API router. When the security
/// subsystem failed to open, every `/v1` request answers `500` (fail closed).
pub fn wrap(api: Router, svc: Arc<Service>, security: Result<Arc<Security>, String>) -> Router {
    match security {
        Ok(sec) => {
            let limit = svc.config().max_json_body_bytes;
            let ctx = Ctx {
                svc: svc.clone(),
                sec,
            };
            // A cluster forwards these routes like the service's: a
            // sandbox's `/policy` and `/egress` to its owner.
            let own = routes(ctx.clone())
                .layer(DefaultBodyLimit::max(limit))
                .layer(axum::middleware::from_fn_with_state(
                    svc,
                    super::forward::layer,
                ));
            api.merge(own)
                .layer(axum::middleware::from_fn_with_state(ctx, authenticate))
        }
        Err(msg) => api.layer(axum::middleware::from_fn_with_state(Arc::new(msg), broken)),
    }
}

/// The handler of a route of this layer (`None`: a route of the service).
fn security_route(r: &Route) -> Option<axum::routing::MethodRouter<Ctx>> {
    use Action::*;
    let m = r.method;
    Some(match r.action {
        Whoami => on(m, whoami),
        CreateToken => on(m, create_token),
        ListTokens => on(m, list_tokens),
        RevokeToken => on(m, revoke_token),
        GetPolicy => on(m, get_policy),
        PutPolicy => on(m, put_policy),
        TestPolicy => on(m, test_policy),
        GetSandboxPolicy => on(m, get_sandbox_policy),
        PutSandboxPolicy => on(m, put_sandbox_policy),
        Egress => on(m, egress),
        ListApprovals => on(m, list_approvals),
        GetApproval => on(m, get_approval),
        Approve => on(m, approve),
        Deny => on(m, deny),
        ExportAudit => on(m, audit_export),
        SetSecret => on(m, set_secret),
        ListSecrets => on(m, list_secrets),
        DeleteSecret => on(m, delete_secret),
        ListConnectors => on(m, list_connectors),
        VerifyAudit => on(m, audit_verify),
        _ => return None,
    })
}

fn routes(ctx: Ctx) -> Router {
    let mut router = Router::new();
    for r in ROUTES {
        if let Some(mr) = security_route(r) {
            router = router.route(r.path, mr);
        }
    }
    router.with_state(ctx)
}

async fn broken(State(msg): State<Arc<String>>, req: Request, next: Next) -> Response {
    let p = req.uri().path();
    if p.starts_with("/v1/") || p == "/metrics" {
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

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

/// Runs a call of the security store on the blocking pool; its error (and a
/// failed task) is `500 internal`.
async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> ApiResult<T>
where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(internal)?
        .map_err(internal)
}

impl axum::extract::FromRef<Ctx> for Arc<Service> {
    fn from_ref(ctx: &Ctx) -> Self {
        ctx.svc.clone()
    }
}

/// Authentication, rate limit and the role of the route (from the route
/// table); the request then carries its [`Caller`] to the handler. Open
/// routes (`/healthz`) and paths outside `/v1` that match no route pass;
/// `/metrics` (every tenant's figures) needs a `metrics` token or an admin
/// of the platform tenant.
async fn authenticate(State(ctx): State<Ctx>, mut req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .and_then(|m| routes::find(req.method().as_str(), m.as_str()));
    let open = match route {
        // A ticket route checks its ticket itself (api::terminal), a host
        // route its host credential (api::transfer).
        Some(r) => matches!(r.access, Access::Open | Access::Ticket(_) | Access::Host),
        None => !req.uri().path().starts_with("/v1/"),
    };
    if open {
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
    if let Some(r) = route {
        let tenant_admin = p.role == Role::Admin && p.tenant != DEFAULT_TENANT;
        if r.access == Access::HostMetrics && tenant_admin {
            return err(
                ErrorCode::Forbidden,
                "/metrics covers every tenant: it needs a metrics token or an admin of the platform tenant",
            );
        }
        if !r.allows(p.role) {
            return err(
                ErrorCode::Forbidden,
                format!(
                    "role {} may not call {} {}",
                    p.role.as_str(),
                    r.method,
                    r.path
                ),
            );
        }
    }
    req.extensions_mut().insert(p.caller());
    next.run(req).await
}

fn unauthorized(f: AuthFailure) -> Response {
    let mut r = err(ErrorCode::Unauthorized, f.message());
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"strata\""),
    );
    r
}

/// The fields of an API caller the security routes use.
struct Who<'a> {
    tenant: &'a str,
    token: &'a str,
    actor: String,
}

fn who(c: &Caller) -> ApiResult<Who<'_>> {
    match c {
        Caller::Api {
            tenant,
            token,
            actor,
            ..
        } => Ok(Who {
            tenant,
            token,
            actor: actor.clone(),
        }),
        _ => Err(ApiError::new(
            ErrorCode::Forbidden,
            "only API callers use these routes",
        )),
    }
}

// ---------------------------------------------------------------- handlers

async fn whoami(Extension(caller): Extension<Caller>) -> ApiResult<impl IntoResponse> {
    let Caller::Api {
        tenant,
        role,
        token,
        name,
        ..
    } = &caller
    else {
        return Err(ApiError::new(ErrorCode::Forbidden, "not an API caller"));
    };
    Ok(Json(json!({
        "token_id": token,
        "tenant": tenant,
        "role": role,
        "name": name,
    })))
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

fn target_tenant(p: &Who<'_>, asked: Option<&str>) -> ApiResult<String> {
    match asked {
        None => Ok(p.tenant.to_owned()),
        Some(t) if t == p.tenant => Ok(t.to_owned()),
        Some(t) => {
            if p.tenant != DEFAULT_TENANT {
                return Err(ApiError::new(
                    ErrorCode::Forbidden,
                    "only admins of the platform tenant `default` act on other tenants",
                ));
            }
            if !valid_tenant(t) {
                return Err(invalid(format!("tenant {t:?}: 1-63 of [a-z0-9-_]")));
            }
            Ok(t.to_owned())
        }
    }
}

async fn create_token(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    Body(b): Body<CreateToken>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let role = b
        .role
        .ok_or_else(|| invalid("role: required (admin, developer, approver, viewer, metrics)"))?;
    let tenant = target_tenant(&p, b.tenant.as_deref())?;
    if role == Role::Metrics && p.tenant != DEFAULT_TENANT {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "metrics tokens read every tenant's figures: only admins of the platform tenant make them",
        ));
    }
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
            Some(
                Utc::now()
                    .checked_add_signed(d)
                    .ok_or_else(|| invalid("expires_in: too far in the future"))?,
            )
        }
    };
    let sec = ctx.sec.clone();
    let by = p.token.to_owned();
    let issued = blocking(move || {
        sec.issue_token(crate::security::NewToken {
            tenant: &tenant,
            role,
            name: b.name,
            expires_at,
            by: &by,
        })
    })
    .await?;
    Ok((StatusCode::CREATED, Json(issued)))
}

fn tenant_param(p: &Who<'_>, q: Option<&str>) -> ApiResult<String> {
    let params = Params::parse(q, &["tenant"], &[], false)?;
    target_tenant(p, params.one("tenant"))
}

async fn list_tokens(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let tenant = tenant_param(&who(&caller)?, q.as_deref())?;
    let store = ctx.sec.store().clone();
    let items = blocking(move || store.tokens(&tenant)).await?;
    Ok(Json(json!({ "items": items })))
}

async fn revoke_token(State(ctx): State<Ctx>, c: Call) -> ApiResult<impl IntoResponse> {
    let (caller, id, q) = c.into_parts();
    let tenant = tenant_param(&who(&caller)?, q.as_deref())?;
    let sec = ctx.sec.clone();
    let id2 = id.clone();
    let rec = blocking(move || {
        let store = sec.store();
        if !store.revoke_token(&tenant, &id2, Utc::now())? {
            return Ok::<_, crate::security::store::SecStoreError>(None);
        }
        let rec = store.token(&tenant, &id2)?;
        if let Some(r) = &rec {
            sec.forget_bootstrap_file(r);
        }
        Ok(rec)
    })
    .await?;
    rec.map(Json)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("token {id} not found")))
}

/// The TOML of a policy PUT. An empty body is refused rather than read as
/// "no rules": a request that lost its body must not clear a layer (a
/// layer without rules is sent as a comment, e.g. `# no rules`).
fn policy_text(body: Bytes) -> ApiResult<String> {
    if body.is_empty() {
        return Err(invalid(
            "policy: empty body (a policy without rules is a comment line, e.g. `# no rules`)",
        ));
    }
    String::from_utf8(body.to_vec()).map_err(|_| invalid("policy: not UTF-8"))
}

async fn get_policy(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let store = ctx.sec.store().clone();
    let t = p.tenant.to_owned();
    let text = blocking(move || store.tenant_policy(&t)).await?;
    Ok(Json(json!({ "tenant": p.tenant, "toml": text })))
}

async fn put_policy(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let text = policy_text(body)?;
    let sec = ctx.sec.clone();
    let (t, by) = (p.tenant.to_owned(), p.token.to_owned());
    tokio::task::spawn_blocking(move || sec.policies().put_tenant(&t, &text, &by))
        .await
        .map_err(internal)?
        .map_err(invalid)?;
    Ok(Json(json!({ "tenant": p.tenant, "updated": true })))
}

async fn get_sandbox_policy(State(ctx): State<Ctx>, c: Call) -> ApiResult<impl IntoResponse> {
    let (caller, id, _) = c.into_parts();
    let sid: SandboxId = super::parse_id(&id)?;
    let rec = ctx.svc.get_sandbox(&caller, &sid).await?;
    let store = ctx.sec.store().clone();
    let key = rec.id.to_string();
    let text = blocking(move || store.sandbox_policy(&key)).await?;
    Ok(Json(json!({ "sandbox": rec.id, "toml": text })))
}

async fn put_sandbox_policy(
    State(ctx): State<Ctx>,
    c: Call,
    body: Bytes,
) -> ApiResult<impl IntoResponse> {
    let (caller, id, _) = c.into_parts();
    let p = who(&caller)?;
    let sid: SandboxId = super::parse_id(&id)?;
    let rec = ctx.svc.get_sandbox(&caller, &sid).await?;
    let text = policy_text(body)?;
    let sec = ctx.sec.clone();
    let (t, by, key) = (rec.tenant.clone(), p.token.to_owned(), rec.id.to_string());
    tokio::task::spawn_blocking(move || sec.policies().put_sandbox(&t, &key, &text, &by))
        .await
        .map_err(internal)?
        .map_err(invalid)?;
    Ok(Json(json!({ "sandbox": rec.id, "updated": true })))
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
    Extension(caller): Extension<Caller>,
    Body(b): Body<TestCall>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let sandbox = match &b.sandbox {
        Some(s) => {
            let sid: SandboxId = super::parse_id(s)?;
            Some(ctx.svc.get_sandbox(&caller, &sid).await?.id.to_string())
        }
        None => None,
    };
    let call = ToolCall {
        tenant: p.tenant.to_owned(),
        sandbox,
        actor: p.actor.clone(),
        kind: b.call.normalized(),
    };
    let sec = ctx.sec.clone();
    let (d, secret) = tokio::task::spawn_blocking(move || {
        let d = sec.evaluate(&call);
        // The secret(s) the proxy would inject on an allowed egress call.
        let secret = match (&call.kind, d.effect) {
            (_, Effect::Deny) => None,
            (CallKind::Egress { host, .. }, _) => {
                let set = sec.policies().set(&call.tenant, call.sandbox.as_deref());
                let conn = set.connector_for_host(host).map(|c| c.name.clone());
                conn.map(|c| {
                    sec.secrets()
                        .would_inject(&call.tenant, call.sandbox.as_deref(), &c)
                })
                .filter(|n| !n.is_empty())
                .map(|n| n.join(","))
            }
            _ => None,
        };
        (d, secret)
    })
    .await
    .map_err(internal)?;
    let mut v = serde_json::to_value(&d).map_err(internal)?;
    if let (Some(s), Some(o)) = (secret, v.as_object_mut()) {
        o.insert("secret".into(), s.into());
    }
    Ok(Json(v))
}

fn secret_error(e: crate::security::secrets::SecretError) -> ApiError {
    use crate::security::secrets::SecretError as E;
    match e {
        E::Invalid(m) => invalid(m),
        E::NotFound(n) => ApiError::new(ErrorCode::NotFound, format!("secret {n} not found")),
        E::Quota(m) => ApiError::new(ErrorCode::QuotaExceeded, m),
        e @ (E::Keys(_) | E::Store(_)) => internal(e),
    }
}

/// `POST /v1/secrets`: writes (or rotates) a connector secret of the
/// caller's tenant; answers its listing (never the value).
async fn set_secret(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    Body(b): Body<crate::security::secrets::SetSecret>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let v = ctx
        .sec
        .secrets()
        .set(p.tenant, &p.actor, b)
        .await
        .map_err(secret_error)?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// `GET /v1/secrets`: the caller's tenant's secrets, names and rules only.
async fn list_secrets(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let (sec, t) = (ctx.sec.clone(), p.tenant.to_owned());
    let items = tokio::task::spawn_blocking(move || sec.secrets().list(&t))
        .await
        .map_err(internal)?
        .map_err(secret_error)?;
    Ok(Json(json!({ "items": items })))
}

/// `DELETE /v1/secrets/{name}`: another tenant's name answers `404` like
/// an unknown one.
async fn delete_secret(State(ctx): State<Ctx>, c: Call) -> ApiResult<impl IntoResponse> {
    let (caller, name, _) = c.into_parts();
    let p = who(&caller)?;
    let (sec, t, n) = (ctx.sec.clone(), p.tenant.to_owned(), name.clone());
    tokio::task::spawn_blocking(move || sec.secrets().delete(&t, &n))
        .await
        .map_err(internal)?
        .map_err(secret_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/connectors`: the connectors of the caller's tenant's policy
/// (platform and tenant layers), their hosts, write block and secrets.
async fn list_connectors(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let (sec, t) = (ctx.sec.clone(), p.tenant.to_owned());
    let items = tokio::task::spawn_blocking(move || {
        let set = sec.policies().set(&t, None);
        set.connectors()
            .map(|(layer, c)| {
                json!({
                    "name": c.name,
                    "layer": layer.as_str(),
                    "hosts": c.hosts.iter().map(|h| match h {
                        HostPattern::Exact(n) => n.clone(),
                        HostPattern::Suffix(s) => format!("*{s}"),
                    }).collect::<Vec<_>>(),
                    "cidrs": c.cidrs.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
                    "ports": c.ports,
                    "tls_ports": c.tls_ports,
                    "read_only": c.read_only,
                    "intercept": c.intercept,
                    "secrets_allowed": c.secrets,
                    "secrets": sec.secrets().would_inject(&t, None, &c.name),
                })
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(internal)?;
    Ok(Json(json!({ "items": items })))
}

async fn egress(State(ctx): State<Ctx>, c: Call) -> ApiResult<impl IntoResponse> {
    let (caller, id, _) = c.into_parts();
    let sid: SandboxId = super::parse_id(&id)?;
    let rec = ctx.svc.get_sandbox(&caller, &sid).await?;
    let guest = Caller::Guest {
        sandbox: rec.id.clone(),
        tenant: rec.tenant.clone(),
    };
    let proxy = ctx
        .sec
        .egress_proxy(&guest)
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("egress proxy: {e}")))?;
    Ok(Json(json!({
        "sandbox": rec.id,
        "proxy": "in-process",
        "guest_proxy": format!("http://{GUEST_PROXY}"),
        "tunnels": proxy.stats(),
    })))
}

async fn list_approvals(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let params = Params::parse(q.as_deref(), &["status"], &[], false)?;
    let pending = match params.one("status") {
        None | Some("pending") => true,
        Some("all") => false,
        Some(other) => {
            return Err(invalid(format!(
                "status {other:?}: expected pending or all"
            )))
        }
    };
    // Listing times out expired pending requests (a store write). A store
    // other processes share is read first: they hold calls too.
    let (q, t) = (ctx.sec.approvals().clone(), p.tenant.to_owned());
    let shared = ctx.sec.shared();
    let items = tokio::task::spawn_blocking(move || {
        if shared {
            q.sync_tenant(&t)?;
        }
        Ok::<_, strata_policy::approval::StoreError>(q.list(&t, pending))
    })
    .await
    .map_err(internal)?
    .map_err(internal)?;
    Ok(Json(json!({ "items": items })))
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
        e @ ApprovalError::TooManyPending { .. } => {
            ApiError::new(ErrorCode::RateLimited, e.to_string())
        }
        e @ (ApprovalError::NotApproved { .. }
        | ApprovalError::Used
        | ApprovalError::Expired(_)) => {
            ApiError::new(ErrorCode::Conflict, format!("approval {id}: {e}"))
        }
        e @ (ApprovalError::OtherRequester | ApprovalError::Mismatch { .. }) => {
            ApiError::new(ErrorCode::Forbidden, format!("approval {id}: {e}"))
        }
    }
}

async fn get_approval(State(ctx): State<Ctx>, c: Call) -> ApiResult<impl IntoResponse> {
    let (caller, id, _) = c.into_parts();
    let p = who(&caller)?;
    let (q, t, id2) = (ctx.sec.approvals().clone(), p.tenant.to_owned(), id.clone());
    let shared = ctx.sec.shared();
    tokio::task::spawn_blocking(move || {
        if shared {
            q.sync(&id2)?;
        }
        q.get(&t, &id2)
    })
    .await
    .map_err(internal)?
    .map(Json)
    .map_err(|e| approval_error(&id, e))
}

/// `POST /v1/approvals/:id/approve|deny` body (optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Answer {
    /// Why, in the answerer's words: kept in the request's status.
    #[serde(default)]
    reason: Option<String>,
}

/// The longest answer reason, in bytes.
const MAX_ANSWER_REASON: usize = 1000;

async fn answer(
    ctx: Ctx,
    caller: Caller,
    id: String,
    approve: bool,
    body: Answer,
) -> ApiResult<Response> {
    let p = who(&caller)?;
    let reason = body
        .reason
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty());
    if reason.as_ref().is_some_and(|r| r.len() > MAX_ANSWER_REASON) {
        return Err(invalid(format!(
            "reason: at most {MAX_ANSWER_REASON} bytes"
        )));
    }
    // With authentication off there is one anonymous caller; let it answer
    // its own requests (local development).
    let answerer = if p.token == "anonymous" {
        "anonymous-approver".to_owned()
    } else {
        p.actor.clone()
    };
    if let Some(r) = answer_on_holder(&ctx, p.tenant, &id, approve, reason.as_deref()).await? {
        return Ok(r);
    }
    let q = ctx.sec.approvals().clone();
    let (t, id2, who2) = (p.tenant.to_owned(), id.clone(), answerer.clone());
    let r =
        tokio::task::spawn_blocking(move || q.answer_with_reason(&t, &id2, &who2, approve, reason))
            .await
            .map_err(internal)?
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
    tokio::task::spawn_blocking(move || sec.record(&call, &d, outcome, Some(rid), Some(answerer)))
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "audit log write failed"))?;
    Ok(Json(r).into_response())
}

/// In a cluster, the answer to approval `id` goes to the host that holds
/// its call (the owner of its sandbox), whose waiter it releases at once
/// and which holds what the call carries (a held upload's bytes, in its
/// data dir): that host's answer, or `None` to answer here (the call is
/// held here, or has no sandbox, or the request was forwarded already).
/// The request is read from the shared store first (another process
/// recorded it).
async fn answer_on_holder(
    ctx: &Ctx,
    tenant: &str,
    id: &str,
    approve: bool,
    reason: Option<&str>,
) -> ApiResult<Option<Response>> {
    let Some(cluster) = ctx.svc.cluster().cloned() else {
        return Ok(None);
    };
    if !ctx.sec.shared() || super::forward::is_forwarded() {
        return Ok(None);
    }
    let (q, t, id2) = (
        ctx.sec.approvals().clone(),
        tenant.to_owned(),
        id.to_owned(),
    );
    let req = tokio::task::spawn_blocking(move || {
        q.sync(&id2)?;
        Ok::<_, strata_policy::approval::StoreError>(q.get(&t, &id2).ok())
    })
    .await
    .map_err(internal)?
    .map_err(internal)?;
    let Some(sandbox) = req
        .and_then(|r| r.sandbox)
        .and_then(|s| s.parse::<SandboxId>().ok())
    else {
        return Ok(None);
    };
    let Some((host, addr)) = cluster.owner_elsewhere(&sandbox).await? else {
        return Ok(None);
    };
    let verb = if approve { "approve" } else { "deny" };
    let body = match reason {
        Some(r) => json!({ "reason": r }).to_string().into_bytes(),
        None => b"{}".to_vec(),
    };
    tracing::debug!(approval = %id, owner = %host, "approval answer forwarded to the host holding the call");
    Ok(Some(
        super::forward::send_to_owner(
            cluster.host_id(),
            &host,
            &addr,
            axum::http::Method::POST,
            &format!("/v1/approvals/{id}/{verb}"),
            body,
        )
        .await,
    ))
}

async fn approve(State(ctx): State<Ctx>, c: Call, Body(b): Body<Answer>) -> ApiResult<Response> {
    let (caller, id, _) = c.into_parts();
    answer(ctx, caller, id, true, b).await
}

async fn deny(State(ctx): State<Ctx>, c: Call, Body(b): Body<Answer>) -> ApiResult<Response> {
    let (caller, id, _) = c.into_parts();
    answer(ctx, caller, id, false, b).await
}

async fn audit_export(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let params = Params::parse(q.as_deref(), &["sandbox", "since"], &[], false)?;
    let since: Option<DateTime<Utc>> = match params.one("since") {
        None => None,
        Some(v) => Some(match DateTime::parse_from_rfc3339(v) {
            Ok(t) => t.with_timezone(&Utc),
            Err(_) => {
                let d = crate::duration::parse_duration(v).map_err(|_| {
                    invalid(format!(
                        "since {v:?}: expected RFC 3339 time or a duration like 10m"
                    ))
                })?;
                chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| Utc::now().checked_sub_signed(d))
                    .ok_or_else(|| invalid("since: too far back"))?
            }
        }),
    };
    let filter = audit::Filter {
        tenant: Some(p.tenant.to_owned()),
        sandbox: params.one("sandbox").map(str::to_owned),
        since,
    };
    let path = ctx.sec.audit_path().to_owned();
    // An unreadable log is a 500 before any byte of the body.
    std::fs::metadata(&path).map_err(internal)?;
    // Streamed: a blocking task reads the log a line at a time and hands
    // the body 64 KiB chunks through a channel of four, so neither the log
    // nor the answer is ever held whole; a client that stops reading stops
    // the reader, one that goes away ends it.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
    tokio::task::spawn_blocking(move || {
        let mut w = ChunkSender {
            tx,
            buf: Vec::with_capacity(EXPORT_CHUNK),
        };
        let r = audit::export(&path, &filter, &mut w).and_then(|_| {
            std::io::Write::flush(&mut w).map_err(|source| audit::AuditError::Io {
                path: path.clone(),
                source,
            })
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "audit export ended early");
            let _ =
                w.tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
    let body = axum::body::Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|c| (c, rx))
    }));
    Ok(([(header::CONTENT_TYPE, super::NDJSON)], body))
}

/// Size of the chunks an audit export is sent in.
const EXPORT_CHUNK: usize = 64 * 1024;

/// A `Write` that sends what is written to a streaming body in chunks.
struct ChunkSender {
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
    buf: Vec<u8>,
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= EXPORT_CHUNK {
            self.flush()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = bytes::Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(EXPORT_CHUNK),
        ));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client went away"))
    }
}

async fn audit_verify(
    State(ctx): State<Ctx>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<impl IntoResponse> {
    let p = who(&caller)?;
    let tenant = p.tenant.to_owned();
    let sec = ctx.sec.clone();
    let keyed = sec.audit().keyed();
    let r = tokio::task::spawn_blocking(move || sec.verify_audit())
        .await
        .map_err(internal)?;
    // The daemon verifies the whole chain (only it holds the key; a
    // tenant's entries link through other tenants'); a tenant's admin is
    // told the verdict and its own tenant's part, the platform tenant's
    // admins every tenant's.
    Ok(Json(match r {
        Ok(v) => {
            let mine = v.tenants.get(&tenant).cloned().unwrap_or_default();
            let mut out = json!({
                "ok": true,
                "entries": v.entries,
                "head": v.head,
                "keyed": keyed,
                "keyed_from": v.keyed_from,
                "unkeyed_entries": v.legacy.0,
                "tenant": tenant,
                "tenant_entries": mine.entries,
                "tenant_decisions": mine.decisions,
                "tenant_first_seq": mine.first_seq,
                "tenant_last_seq": mine.last_seq,
            });
            if tenant == crate::store::DEFAULT_TENANT {
                out["tenants"] = json!(v.tenants);
            }
            out
        }
        Err(e) => json!({ "ok": false, "keyed": keyed, "tenant": tenant, "error": e.to_string() }),
    }))
}
