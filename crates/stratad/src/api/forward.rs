//! Cluster forwarding (docs/cluster.md, "Forwarding"): on a cluster host, a
//! request on `/v1/sandboxes/{id}/…` for a sandbox whose lease another
//! host holds is proxied over HTTP to that host's advertised address,
//! request and response bodies streamed both ways; a create that placement
//! puts on another host is re-sent there.
//!
//! - The caller's `Authorization` (and every other end-to-end header) goes
//!   as-is: the owner authenticates and authorizes the caller again;
//!   nothing is trusted from the forwarding host.
//! - A forwarded request carries [`FORWARDED_HEADER`] and is never forwarded
//!   again (no loops): its receiver answers it itself.
//! - The owner unreachable within [`CONNECT_TIMEOUT`]: `503` with code
//!   `owner_unreachable`; an answer that breaks off: `502`
//!   `owner_unreachable`.
//! - `/v1/snapshots/{id}[/…]` (get, delete, fork of a snapshot) goes to
//!   the owner of the snapshot's sandbox the same way.
//! - Connection upgrades on a sandbox (the WebSocket terminal, a guest
//!   port's WebSocket) go to the owner too ([`proxy_upgrade`]): the owner's
//!   `101`, then the bytes copied both ways.
//! - The security layer's per-sandbox routes (`/policy`, `/egress`) are
//!   forwarded like every sandbox route (the layer wraps them too); an
//!   approval's answer goes to the host that holds the call
//!   ([`send_to_owner`], from `api::security`).
//! - Not forwarded: other routes (reads of records are served from the
//!   shared store by any host).
//! - Another door (the E2B door, which names its sandbox by path, header or
//!   `Host` and has its own error shape) goes through [`door`]: the same
//!   rules, its refusals in that door's shape ([`DoorRefusal`]).
//! - An API-only process (`[cluster] role = "api"`) runs no VMs: a call that
//!   needs a host ([`Action::runs_on_host`]) and cannot be forwarded is
//!   refused before any handler runs: `503 no_owner` for a live sandbox no
//!   host holds, `421 host_required` for the rest (a template build, an
//!   import), naming where to go when it can.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde_json::json;
use strata_core::SandboxId;

use super::routes::{self, Action};
use crate::service::Service;

/// Marks a request one host forwarded to another (value: the forwarding
/// host's id). A request carrying it is answered where it arrives.
pub const FORWARDED_HEADER: &str = "x-strata-forwarded-by";
/// The bound on connecting to the owner.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The machine-readable code of an owner that cannot be reached.
pub const OWNER_UNREACHABLE: &str = "owner_unreachable";
/// On every answer of a cluster host: the id of the host that answered
/// (a forwarded answer carries the owner's).
pub const HOST_HEADER: &str = "x-strata-host";
/// The code of a call an API-only process cannot serve and has no host to
/// forward to (`421`).
pub const HOST_REQUIRED: &str = "host_required";
/// The code of a VM operation on a live sandbox that no host holds (`503`;
/// a host takes a lost host's sandboxes into custody after its lease
/// expired).
pub const NO_OWNER: &str = "no_owner";

/// What a request's handling tells the forwarding layer (task-local).
#[derive(Default)]
struct Ctx {
    /// The request arrived forwarded.
    forwarded: bool,
    /// Placement chose another host (its address) for a create.
    placed: Mutex<Option<String>>,
    /// The caller's `Authorization` header, for the calls this request
    /// makes to other hosts on the caller's behalf (a template fetch).
    authorization: Option<HeaderValue>,
}

tokio::task_local! {
    static CTX: Arc<Ctx>;
}

/// Whether the request being handled was forwarded by another host (a
/// create then skips placement: the chosen host's admission decides).
pub fn is_forwarded() -> bool {
    CTX.try_with(|c| c.forwarded).unwrap_or(false)
}

/// Placement put the create being handled on the host at `addr`: the
/// forwarding layer re-sends it there (when it can).
pub fn placed_on(addr: &str) {
    let _ = CTX.try_with(|c| {
        *c.placed.lock().unwrap_or_else(|p| p.into_inner()) = Some(addr.to_owned());
    });
}

/// The caller's `Authorization` header of the request being handled (a
/// cluster host's calls to other hosts on the caller's behalf carry it, so
/// the other host authenticates and authorizes the caller itself).
pub fn caller_authorization() -> Option<HeaderValue> {
    CTX.try_with(|c| c.authorization.clone()).ok().flatten()
}

/// The HTTP client of calls between hosts: connecting is bounded by
/// [`CONNECT_TIMEOUT`], no pooled connections, no redirects.
pub(crate) fn client() -> &'static reqwest::Client {
    static C: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // Every forward connects anew, so that the connect bound holds:
            // a pooled connection to a host that went silent (a cut link)
            // would take the request and hang until TCP gives up.
            .pool_max_idle_per_host(0)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_else(|_| reqwest::Client::new())
    })
}

fn unreachable(status: StatusCode, host: &str, why: impl std::fmt::Display) -> Response {
    let message = format!(
        "host {host} (which owns this sandbox or was chosen for it) cannot be reached: {why}"
    );
    let mut r = (
        status,
        axum::Json(json!({ "error": { "code": OWNER_UNREACHABLE, "message": &message }})),
    )
        .into_response();
    r.extensions_mut()
        .insert(DoorRefusal::new(status, OWNER_UNREACHABLE, message));
    r
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those the client recomputes.
fn hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !hop(k) {
            to.append(k.clone(), v.clone());
        }
    }
}

/// Sends `method path` with `headers` and `body` to the host at `addr` and
/// streams its answer back.
async fn proxy(
    me: &str,
    host: &str,
    addr: &str,
    method: Method,
    path_query: &str,
    headers: &HeaderMap,
    body: reqwest::Body,
) -> Response {
    let url = format!("{}{}", addr.trim_end_matches('/'), path_query);
    let mut out = HeaderMap::new();
    copy_headers(headers, &mut out);
    if let Ok(v) = me.parse() {
        out.insert(FORWARDED_HEADER, v);
    }
    let sent = client()
        .request(method, &url)
        .headers(out)
        .body(body)
        .send()
        .await;
    let (resp, b) = match answered(sent, host) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    b.body(AxumBody::from_stream(stream))
        .unwrap_or_else(|e| unreachable(StatusCode::BAD_GATEWAY, host, e))
}

/// After a create ran here (answered `resp`): when its placement chose
/// another host, the same request is re-sent there and that host's answer
/// is the one given (the `/v1` API's and the E2B door's creates alike).
async fn follow_placement(
    me: &str,
    ctx: &Ctx,
    resp: Response,
    parts: axum::http::request::Parts,
    path_query: &str,
    bytes: bytes::Bytes,
) -> Response {
    let placed = ctx.placed.lock().unwrap_or_else(|p| p.into_inner()).take();
    let Some(addr) = placed else {
        return resp;
    };
    tracing::debug!(to = %addr, "create forwarded to the host placement chose");
    proxy(
        me,
        &addr,
        &addr,
        parts.method,
        path_query,
        &parts.headers,
        reqwest::Body::from(bytes),
    )
    .await
}

/// The owner's answer to a forwarded request and a response builder with
/// its status and end-to-end headers; `Err`: the `503`/`502`
/// `owner_unreachable` to answer instead.
fn answered(
    sent: Result<reqwest::Response, reqwest::Error>,
    host: &str,
) -> Result<(reqwest::Response, axum::http::response::Builder), Box<Response>> {
    let resp = match sent {
        Ok(r) => r,
        Err(e) if e.is_connect() || e.is_timeout() => {
            return Err(Box::new(unreachable(
                StatusCode::SERVICE_UNAVAILABLE,
                host,
                e,
            )))
        }
        Err(e) => return Err(Box::new(unreachable(StatusCode::BAD_GATEWAY, host, e))),
    };
    let mut b = Response::builder().status(resp.status().as_u16());
    if let Some(h) = b.headers_mut() {
        copy_headers(resp.headers(), h);
    }
    Ok((resp, b))
}

fn refuse(status: StatusCode, code: &str, message: String) -> Response {
    let mut r = (
        status,
        axum::Json(json!({ "error": { "code": code, "message": &message } })),
    )
        .into_response();
    r.extensions_mut()
        .insert(DoorRefusal::new(status, code, message));
    r
}

/// The sandbox id of a `/v1/sandboxes/{id}[/…]` path.
fn sandbox_of(path: &str) -> Option<SandboxId> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let seg = rest.split('/').next()?;
    seg.parse().ok()
}

/// The sandbox a request is about: the `{id}` of `/v1/sandboxes/{id}[/…]`,
/// or the sandbox of the snapshot of `/v1/snapshots/{id}[/…]` (one read;
/// an unknown snapshot is answered here, `404`).
async fn subject_of(svc: &Service, path: &str) -> Option<SandboxId> {
    if let Some(id) = sandbox_of(path) {
        return Some(id);
    }
    let rest = path.strip_prefix("/v1/snapshots/")?;
    let snap: strata_core::SnapshotId = rest.split('/').next()?.parse().ok()?;
    svc.db(move |s| s.get_snapshot(&snap))
        .await
        .ok()
        .flatten()
        .map(|r| r.sandbox_id)
}

/// The route's action (the router matched it before this layer runs).
fn action_of(req: &Request) -> Option<Action> {
    let m = req.extensions().get::<axum::extract::MatchedPath>()?;
    routes::find(req.method().as_str(), m.as_str()).map(|r| r.action)
}

/// An API-only process's refusal of a call that needs a host and was not
/// forwarded: `no_owner` for a live sandbox no host holds, else
/// `host_required`. `None`: the call is answered here (a record the
/// handler reads, or an unknown or deleted sandbox: its `404`).
async fn api_refusal(
    svc: &Service,
    me: &str,
    sandbox: Option<&SandboxId>,
    forwarded: bool,
    label: &str,
) -> Option<Response> {
    let why = format!(
        "this stratad ({me}) is an API-only process ([cluster] role = \"api\"): it runs no VMs, and {label} needs a host"
    );
    let Some(id) = sandbox else {
        return Some(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            HOST_REQUIRED,
            format!("{why}: send it to a host's address"),
        ));
    };
    if forwarded {
        return Some(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            HOST_REQUIRED,
            format!("{why}; a request marked {FORWARDED_HEADER} is not forwarded again"),
        ));
    }
    let id2 = id.clone();
    let rec = svc.db(move |s| s.get_sandbox(&id2)).await.ok().flatten()?;
    if rec.state == strata_core::SandboxState::Deleted {
        return None;
    }
    Some(refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        NO_OWNER,
        format!(
            "{why}, and no host holds sandbox {id}'s lease (its host was lost and no other host took it into custody yet, or it predates the cluster); retry once a host holds it"
        ),
    ))
}

/// The forwarding layer (a no-op unless this service is a cluster host).
pub(super) async fn layer(State(svc): State<Arc<Service>>, req: Request, next: Next) -> Response {
    let Some(cluster) = svc.cluster().cloned() else {
        return next.run(req).await;
    };
    let me = cluster.host_id().to_owned();
    let mut resp = route(&svc, &cluster, req, next).await;
    if !resp.headers().contains_key(HOST_HEADER) {
        if let Ok(v) = me.parse() {
            resp.headers_mut().insert(HOST_HEADER, v);
        }
    }
    resp
}

async fn route(
    svc: &Arc<Service>,
    cluster: &Arc<crate::cluster::Cluster>,
    req: Request,
    next: Next,
) -> Response {
    let forwarded = req.headers().contains_key(FORWARDED_HEADER);
    let upgrade = req.headers().contains_key(header::UPGRADE);
    let api = cluster.is_api();
    let ctx = Arc::new(Ctx {
        forwarded,
        authorization: req.headers().get(header::AUTHORIZATION).cloned(),
        ..Default::default()
    });
    if !api && forwarded {
        return CTX.scope(ctx, next.run(req)).await;
    }
    let me = cluster.host_id().to_owned();
    // An API-only process answers a host's call only by forwarding it.
    let needs_host = api && action_of(&req).is_some_and(Action::runs_on_host);
    let label = format!("{} {}", req.method(), req.uri().path());
    let subject = subject_of(svc, req.uri().path()).await;
    if forwarded {
        if needs_host {
            if let Some(r) = api_refusal(svc, &me, subject.as_ref(), true, &label).await {
                return r;
            }
        }
        return CTX.scope(ctx, next.run(req)).await;
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| req.uri().path().to_owned());
    if let Some(id) = subject {
        let owner = match cluster.owner_elsewhere(&id).await {
            Ok(o) => o,
            Err(e) => return super::ApiError::from(e).into_response(),
        };
        let Some((host, addr)) = owner else {
            if needs_host {
                if let Some(r) = api_refusal(svc, &me, Some(&id), false, &label).await {
                    return r;
                }
            }
            return CTX.scope(ctx, next.run(req)).await;
        };
        if upgrade {
            tracing::debug!(sandbox = %id, owner = %host, "upgrade forwarded");
            return proxy_upgrade(&me, &host, &addr, &pq, req).await;
        }
        let (parts, body) = req.into_parts();
        let body = reqwest::Body::wrap_stream(body.into_data_stream());
        tracing::debug!(sandbox = %id, owner = %host, "forwarded");
        return proxy(&me, &host, &addr, parts.method, &pq, &parts.headers, body).await;
    }
    if req.method() == Method::POST && req.uri().path() == "/v1/sandboxes" {
        // A create: kept (bounded like any JSON body) so that it can be
        // re-sent to the host placement picks.
        let limit = svc.config().max_json_body_bytes;
        let (parts, body) = req.into_parts();
        let bytes = match axum::body::to_bytes(body, limit).await {
            Ok(b) => b,
            Err(_) => {
                return super::ApiError::new(
                    strata_core::ErrorCode::PayloadTooLarge,
                    format!("body over {limit} bytes"),
                )
                .into_response()
            }
        };
        let local = Request::from_parts(parts.clone(), AxumBody::from(bytes.clone()));
        let resp = CTX.scope(ctx.clone(), next.run(local)).await;
        return follow_placement(&me, &ctx, resp, parts, &pq, bytes).await;
    }
    if needs_host {
        if let Some(r) = api_refusal(svc, &me, None, false, &label).await {
            return r;
        }
    }
    CTX.scope(ctx, next.run(req)).await
}

// Other doors on a cluster: the E2B door (`strata-e2b`; docs/cluster.md,
// "The E2B door on a cluster") names its sandbox in its own way (a path,
// the `E2b-Sandbox-Id` header, a `Host`) and answers errors in its own
// shape; the forwarding itself is this module's.

/// A refusal this module answers itself (owner unreachable, host required,
/// no owner, a body too large to re-send, a failed owner lookup): status,
/// machine-readable code and message. Each such answer carries one in its
/// extensions, and [`door`] hands it to the door's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoorRefusal {
    /// HTTP status.
    pub status: StatusCode,
    /// [`OWNER_UNREACHABLE`], [`HOST_REQUIRED`], [`NO_OWNER`], or the name
    /// of a [`strata_core::ErrorCode`].
    pub code: String,
    /// What happened, for a person.
    pub message: String,
}

impl DoorRefusal {
    fn new(status: StatusCode, code: &str, message: String) -> Self {
        DoorRefusal {
            status,
            code: code.to_owned(),
            message,
        }
    }
}

/// What a request of another door is about, as that door reads it; decides
/// what [`door`] does with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DoorCall {
    /// An operation on one sandbox: forwarded to its lease holder when
    /// another host holds it; else answered here, except on an API process
    /// when not `read` (`503 no_owner` for a live sandbox, as `/v1`).
    Sandbox {
        /// The sandbox.
        id: SandboxId,
        /// A read of records, answered here when no host holds the sandbox.
        read: bool,
    },
    /// A create: run here (placement decides); when placement picks
    /// another host, its body (kept, at most `limit` bytes, else `413`) and
    /// headers are sent there.
    Create {
        /// The largest body kept for the re-send.
        limit: usize,
    },
    /// Runs on a host and names no sandbox (a template build): an API
    /// process refuses it (`421 host_required`), a host runs it.
    HostOnly,
    /// Answered where it arrives (lists, reads of records).
    Local,
}

/// Serves one request of another door (the E2B door) on a cluster as `/v1`
/// requests are served ([`layer`]): `call` forwarded to the sandbox's
/// lease holder (same loop rule, `owner_unreachable`, streaming, the
/// caller's credential headers sent as they came for the owner's door to
/// check again), a create placed and re-sent, an API process's refusals;
/// anything answered here goes to `run` within the request's context (a
/// create then reports placement, a forwarded one skips it). This module's
/// own refusals are answered through `shape` (the door's error format);
/// every answer carries [`HOST_HEADER`]. Without `[cluster]`: `run(req)`.
pub async fn door<F, Fut, S>(
    svc: &Arc<Service>,
    call: DoorCall,
    req: Request,
    shape: S,
    run: F,
) -> Response
where
    F: FnOnce(Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
    S: FnOnce(DoorRefusal) -> Response,
{
    let Some(cluster) = svc.cluster().cloned() else {
        return run(req).await;
    };
    let me = cluster.host_id().to_owned();
    let mut resp = door_route(svc, &cluster, call, req, run).await;
    if let Some(r) = resp.extensions_mut().remove::<DoorRefusal>() {
        resp = shape(r);
    }
    if !resp.headers().contains_key(HOST_HEADER) {
        if let Ok(v) = me.parse() {
            resp.headers_mut().insert(HOST_HEADER, v);
        }
    }
    resp
}

async fn door_route<F, Fut>(
    svc: &Arc<Service>,
    cluster: &Arc<crate::cluster::Cluster>,
    call: DoorCall,
    req: Request,
    run: F,
) -> Response
where
    F: FnOnce(Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    let forwarded = req.headers().contains_key(FORWARDED_HEADER);
    let api = cluster.is_api();
    let me = cluster.host_id().to_owned();
    let label = format!("{} {}", req.method(), req.uri().path());
    let ctx = Arc::new(Ctx {
        forwarded,
        authorization: req.headers().get(header::AUTHORIZATION).cloned(),
        ..Default::default()
    });
    if forwarded {
        // Never forwarded again; an API process runs no host's call.
        if api && call != DoorCall::Local {
            let id = match &call {
                DoorCall::Sandbox { id, .. } => Some(id),
                _ => None,
            };
            if let Some(r) = api_refusal(svc, &me, id, true, &label).await {
                return r;
            }
        }
        return CTX.scope(ctx, run(req)).await;
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| req.uri().path().to_owned());
    match call {
        DoorCall::Local => CTX.scope(ctx, run(req)).await,
        DoorCall::HostOnly => {
            if api {
                if let Some(r) = api_refusal(svc, &me, None, false, &label).await {
                    return r;
                }
            }
            CTX.scope(ctx, run(req)).await
        }
        DoorCall::Sandbox { id, read } => {
            let owner = match cluster.owner_elsewhere(&id).await {
                Ok(o) => o,
                Err(e) => {
                    let e = super::ApiError::from(e);
                    let status = StatusCode::from_u16(e.status())
                        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                    return refuse(status, &e.code.as_str(), e.message);
                }
            };
            let Some((host, addr)) = owner else {
                if api && !read {
                    if let Some(r) = api_refusal(svc, &me, Some(&id), false, &label).await {
                        return r;
                    }
                }
                return CTX.scope(ctx, run(req)).await;
            };
            if req.headers().contains_key(header::UPGRADE) {
                return refuse(
                    StatusCode::MISDIRECTED_REQUEST,
                    HOST_REQUIRED,
                    format!(
                        "this stratad ({me}) does not forward connection upgrades (WebSocket); connect to host {host} at {addr}, which runs sandbox {id}"
                    ),
                );
            }
            let (parts, body) = req.into_parts();
            let body = reqwest::Body::wrap_stream(body.into_data_stream());
            tracing::debug!(sandbox = %id, owner = %host, "door request forwarded");
            proxy(&me, &host, &addr, parts.method, &pq, &parts.headers, body).await
        }
        DoorCall::Create { limit } => {
            let (parts, body) = req.into_parts();
            let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
                return refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &strata_core::ErrorCode::PayloadTooLarge.as_str(),
                    format!("request body larger than {limit} bytes (or it broke off)"),
                );
            };
            let local = Request::from_parts(parts.clone(), AxumBody::from(bytes.clone()));
            let resp = CTX.scope(ctx.clone(), run(local)).await;
            follow_placement(&me, &ctx, resp, parts, &pq, bytes).await
        }
    }
}

/// Forwards a connection upgrade (the WebSocket terminal, a guest port's
/// WebSocket) to the owner at `addr`: the request with its `Upgrade` and
/// the client's own `Host` (the owner's same-origin check of a terminal
/// compares the browser's `Origin` with the host the browser reached, not
/// with the owner's address), connecting bounded like every forward. An
/// answer other than `101` (the owner's `401` of a spent ticket) is
/// returned as is; on `101` the client's and the owner's upgraded
/// connections are joined, bytes copied both ways until either side
/// closes.
async fn proxy_upgrade(
    me: &str,
    host: &str,
    addr: &str,
    path_query: &str,
    mut req: Request,
) -> Response {
    let client_side = hyper::upgrade::on(&mut req);
    let (parts, _) = req.into_parts();
    let url = format!("{}{}", addr.trim_end_matches('/'), path_query);
    let mut out = HeaderMap::new();
    copy_headers(&parts.headers, &mut out);
    for name in [header::UPGRADE, header::HOST] {
        if let Some(v) = parts.headers.get(&name) {
            out.insert(name, v.clone());
        }
    }
    out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    if let Ok(v) = me.parse() {
        out.insert(FORWARDED_HEADER, v);
    }
    let sent = client()
        .request(parts.method, &url)
        .headers(out)
        .send()
        .await;
    let (resp, mut b) = match answered(sent, host) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
        let stream = resp.bytes_stream().map_err(std::io::Error::other);
        return b
            .body(AxumBody::from_stream(stream))
            .unwrap_or_else(|e| unreachable(StatusCode::BAD_GATEWAY, host, e));
    }
    if let Some(h) = b.headers_mut() {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Some(p) = resp.headers().get(header::UPGRADE) {
            h.insert(header::UPGRADE, p.clone());
        }
    }
    let owner = host.to_owned();
    tokio::spawn(async move {
        let (mut theirs, ours) = match tokio::try_join!(
            async { resp.upgrade().await.map_err(|e| e.to_string()) },
            async { client_side.await.map_err(|e| e.to_string()) },
        ) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(owner = %owner, error = %e, "forwarded upgrade failed");
                return;
            }
        };
        let mut ours = hyper_util::rt::TokioIo::new(ours);
        if let Err(e) = tokio::io::copy_bidirectional(&mut ours, &mut theirs).await {
            tracing::debug!(owner = %owner, error = %e, "forwarded upgraded connection ended");
        }
    });
    b.body(AxumBody::empty())
        .unwrap_or_else(|e| unreachable(StatusCode::BAD_GATEWAY, host, e))
}

/// Sends `method path_query` with the JSON `body` and the caller's
/// `Authorization` to host `host` at `addr`, marked forwarded (the owner
/// authenticates and authorizes the caller again, and answers it itself),
/// and returns its answer: a call only that host can complete (the answer
/// to an approval of a call it holds, `api::security`).
pub(crate) async fn send_to_owner(
    me: &str,
    host: &str,
    addr: &str,
    method: Method,
    path_query: &str,
    body: Vec<u8>,
) -> Response {
    let mut h = HeaderMap::new();
    if let Some(a) = caller_authorization() {
        h.insert(header::AUTHORIZATION, a);
    }
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    proxy(
        me,
        host,
        addr,
        method,
        path_query,
        &h,
        reqwest::Body::from(body),
    )
    .await
}
