//! The MCP gateway (`docs/mcp.md`): connectors of kind `mcp` offered to a
//! sandbox's guest at `http://mcp.strata.internal/<connector>/mcp`, reached
//! through the guest's egress proxy (`HTTP_PROXY`) like any plain-HTTP
//! request, but answered here instead of being forwarded.
//!
//! The guest speaks MCP streamable HTTP (JSON-RPC over `POST`; answers as
//! `application/json`, or `text/event-stream` for a `tools/call` when the
//! client accepts it). Each message is read under bounds ([`rpc`]);
//! `tools/list` answers are filtered by policy and their annotations set
//! from the admin's catalog; every `tools/call` is decided by policy
//! (allow / deny / approve) and audited (server, tool, decision, argument
//! digest); a held call sends `notifications/progress` (or SSE comments)
//! while it waits for a human; resources, prompts and other methods are
//! refused.
//!
//! Upstreams: a streamable-HTTP server (the client's `Mcp-Session-Id`
//! passed through), or a stdio server the daemon runs on the host
//! ([`stdio`]): one process per gateway session (started by the session's
//! `initialize`, at most [`McpLimits::sessions_per_connector`] per sandbox
//! and connector), killed by `DELETE`, after [`McpLimits::idle`], or with
//! the sandbox's proxy. Credentials (headers, env) come from the
//! connector's definition through [`credentials`], never from the guest.

pub mod rpc;
mod stdio;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::decide::{hold, record, Held};
use super::http::{full, Body};
use super::ProxyConfig;
use crate::audit::Outcome;
use crate::policy::{Connector, Decision, Effect, McpServer, McpUpstream};
use rpc::{Message, Route};
use stdio::StdioServer;

/// The host name the gateway answers on, through the guest's proxy.
pub const HOST: &str = "mcp.strata.internal";

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";

/// Bounds of one sandbox's gateway.
#[derive(Debug, Clone, Copy)]
pub struct McpLimits {
    /// Stdio server processes (sessions) per sandbox and connector.
    pub sessions_per_connector: usize,
    /// A stdio server with no request for this long is stopped.
    pub idle: Duration,
    /// Longest wait for an upstream's answer to one request.
    pub call_timeout: Duration,
    /// How often a held call reports progress (or keeps its stream alive).
    pub progress_every: Duration,
    /// A tenant-layer connector may run a stdio command on the host (else
    /// only the platform layer's may).
    pub tenant_stdio: bool,
    /// A tenant-layer connector's `url` may reach non-public addresses
    /// (loopback, private, link-local…; else refused, like egress).
    pub tenant_private_urls: bool,
}

impl Default for McpLimits {
    fn default() -> Self {
        McpLimits {
            sessions_per_connector: 4,
            idle: Duration::from_secs(600),
            call_timeout: Duration::from_secs(600),
            progress_every: Duration::from_secs(2),
            tenant_stdio: false,
            tenant_private_urls: false,
        }
    }
}

/// The credentials the gateway sends a connector's server: the headers of
/// an HTTP server, the environment of a stdio one, as the admin's
/// connector definition gives them, each `strata:secret/<name>`
/// placeholder replaced by the value of the tenant's connector secret
/// `name` bound to this connector (`POST /v1/secrets`), which the proxy's
/// request hook (the secrets broker) resolves. The guest never sees these
/// values; a placeholder that names no such secret refuses the call.
pub async fn credentials(
    cfg: &ProxyConfig,
    connector: &str,
    server: &McpServer,
) -> Result<BTreeMap<String, String>, String> {
    let raw = match &server.upstream {
        McpUpstream::Http { headers, .. } => headers,
        McpUpstream::Stdio { env, .. } => env,
    };
    let mut out = BTreeMap::new();
    for (k, v) in raw {
        out.insert(k.clone(), resolve(cfg, connector, v).await?);
    }
    Ok(out)
}

/// `v` with every `strata:secret/<name>` replaced by that secret's value.
async fn resolve(cfg: &ProxyConfig, connector: &str, v: &str) -> Result<String, String> {
    use crate::secrets::PLACEHOLDER_PREFIX;
    if !v.contains(PLACEHOLDER_PREFIX) {
        return Ok(v.to_owned());
    }
    let Some(hook) = &cfg.request_hook else {
        return Err(format!(
            "connector `{connector}` names a secret, and this deployment has no secrets broker"
        ));
    };
    let mut out = String::new();
    for piece in crate::secrets::placeholder_pieces(v) {
        let name = match piece {
            crate::secrets::Piece::Text(t) => {
                out.push_str(t);
                continue;
            }
            crate::secrets::Piece::Secret(name) => name,
        };
        let value = hook
            .secret_value(&cfg.tenant, connector, name)
            .await?
            .ok_or_else(|| {
                format!("connector `{connector}` names secret `{name}`, which is not one of this tenant's secrets bound to it")
            })?;
        out.push_str(&value);
    }
    Ok(out)
}

struct Session {
    connector: String,
    command: Vec<String>,
    server: Arc<StdioServer>,
}

/// One sandbox's MCP gateway: its stdio sessions.
pub struct McpGateway {
    limits: McpLimits,
    sessions: Mutex<HashMap<String, Session>>,
}

impl std::fmt::Debug for McpGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpGateway")
            .field("sessions", &self.lock().len())
            .finish()
    }
}

impl McpGateway {
    /// A gateway with `limits`; a background task stops idle stdio servers
    /// (it ends with the gateway).
    pub fn new(limits: McpLimits) -> Arc<McpGateway> {
        let g = Arc::new(McpGateway {
            limits,
            sessions: Mutex::new(HashMap::new()),
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            let weak = Arc::downgrade(&g);
            let every =
                (limits.idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(g) = weak.upgrade() else { break };
                    g.lock().retain(|_, s| {
                        let keep = s.server.is_alive() && !s.server.idle_for(g.limits.idle);
                        if !keep {
                            s.server.kill();
                        }
                        keep
                    });
                }
            });
        }
        g
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Running stdio servers.
    pub fn running(&self) -> usize {
        self.lock().values().filter(|s| s.server.is_alive()).count()
    }

    /// Stops every stdio server (the sandbox is going away).
    pub fn stop(&self) {
        for (_, s) in self.lock().drain() {
            s.server.kill();
        }
    }

    /// Serves one guest request to [`HOST`].
    pub(super) async fn serve(
        self: Arc<Self>,
        cfg: Arc<ProxyConfig>,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let path = req.uri().path().to_string();
        let name = match path
            .strip_prefix('/')
            .and_then(|p| p.strip_suffix("/mcp"))
            .filter(|n| !n.is_empty() && !n.contains('/'))
        {
            Some(n) => n.to_string(),
            None => {
                return plain(
                    StatusCode::NOT_FOUND,
                    "the MCP gateway serves /<connector>/mcp",
                )
            }
        };
        let policy = cfg.policy.current();
        let Some((layer, conn)) = policy
            .connectors()
            .find(|(_, c)| c.name == name && c.mcp.is_some())
            .map(|(l, c)| (l, c.clone()))
        else {
            return plain(
                StatusCode::NOT_FOUND,
                &format!("no MCP connector `{name}` in this sandbox's policy"),
            );
        };
        let session = header_str(&req, SESSION_HEADER);
        let version = header_str(&req, VERSION_HEADER);
        let sse_ok = header_str(&req, "accept").is_some_and(|a| a.contains("text/event-stream"));
        match *req.method() {
            Method::POST => {}
            Method::DELETE => {
                if let Some(s) = session {
                    if let Some(s) = self.lock().remove(&s) {
                        s.server.kill();
                    }
                }
                return plain(StatusCode::OK, "session ended");
            }
            _ => {
                let mut r = plain(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "the gateway offers no server-initiated stream; POST messages",
                );
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("POST, DELETE"));
                return r;
            }
        }
        let body = match Limited::new(req.into_body(), rpc::MAX_MESSAGE)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return json_reply(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &rpc::error(
                        &Value::Null,
                        rpc::INVALID_REQUEST,
                        "message larger than the gateway's limit",
                        None,
                    ),
                    None,
                )
            }
        };
        let (msg, kind) = match rpc::parse(&body) {
            Ok(x) => x,
            Err(r) => {
                return json_reply(
                    StatusCode::BAD_REQUEST,
                    &rpc::error(&r.id, r.code, &r.message, None),
                    None,
                )
            }
        };
        let up = Up {
            cfg: cfg.clone(),
            gw: self.clone(),
            platform: layer == crate::policy::Layer::Platform,
            conn: conn.clone(),
            session,
            version,
        };
        let (id, method, params) = match kind {
            Message::Notification { .. } | Message::Response => {
                return match up.send(&msg, None, None).await {
                    Ok(x) => {
                        let mut r = Response::new(full(Bytes::new()));
                        *r.status_mut() = StatusCode::ACCEPTED;
                        set_session(&mut r, x.session.as_deref());
                        r
                    }
                    Err(e) => e.reply(&Value::Null),
                };
            }
            Message::Request { id, method, params } => (id, method, params),
        };
        match rpc::route(&method) {
            Route::Refuse => json_reply(
                StatusCode::OK,
                &rpc::error(
                    &id,
                    rpc::METHOD_NOT_FOUND,
                    &format!(
                        "`{method}` is not offered through the strata MCP gateway (tools only)"
                    ),
                    None,
                ),
                None,
            ),
            Route::Pass => match up.send(&msg, Some(&id), None).await {
                Ok(x) => x.collect(&id, self.limits.call_timeout, |_| {}).await,
                Err(e) => e.reply(&id),
            },
            Route::ListTools => match up.send(&msg, Some(&id), None).await {
                Ok(x) => {
                    let tmpl = rpc::call(
                        &cfg.tenant,
                        cfg.sandbox.as_deref(),
                        &cfg.actor,
                        &conn.name,
                        "",
                        None,
                    );
                    x.collect(&id, self.limits.call_timeout, |v| {
                        let gone = rpc::filter_tools(v, &policy, &tmpl, &conn);
                        if !gone.is_empty() {
                            tracing::debug!(connector = %conn.name, hidden = ?gone, "tools/list filtered");
                        }
                    })
                    .await
                }
                Err(e) => e.reply(&id),
            },
            Route::CallTool => {
                let (tool, args) = match rpc::tool_call(params.as_ref()) {
                    Ok(x) => x,
                    Err(why) => {
                        return json_reply(
                            StatusCode::OK,
                            &rpc::error(&id, rpc::INVALID_PARAMS, why, None),
                            None,
                        )
                    }
                };
                let call = rpc::call(
                    &cfg.tenant,
                    cfg.sandbox.as_deref(),
                    &cfg.actor,
                    &conn.name,
                    &tool,
                    Some(&args),
                );
                let d = policy.evaluate(&call);
                let token = rpc::progress_token(params.as_ref());
                match d.effect {
                    Effect::Deny => {
                        let _ = record(&cfg, &call, &d, Outcome::Denied, None, None);
                        json_reply(StatusCode::OK, &denial(&id, &d, None), None)
                    }
                    Effect::Allow => {
                        if !record(&cfg, &call, &d, Outcome::Allowed, None, None) {
                            return json_reply(StatusCode::OK, &unaudited(&id), None);
                        }
                        match up.send(&msg, Some(&id), token).await {
                            Ok(x) if sse_ok => x.stream(id, self.limits.call_timeout),
                            Ok(x) => x.collect(&id, self.limits.call_timeout, |_| {}).await,
                            Err(e) => e.reply(&id),
                        }
                    }
                    Effect::Approve => {
                        let (tx, rx) = mpsc::channel::<Bytes>(16);
                        let limits = self.limits;
                        let session = up.session.clone();
                        tokio::spawn(async move {
                            held_call(cfg, up, call, d, msg, id, token, limits, tx).await;
                        });
                        sse_response(rx, session.as_deref())
                    }
                }
            }
        }
    }
}

/// Runs a held `tools/call` on its SSE stream: progress (or keep-alive
/// comments) while it waits, then the upstream's messages, or the refusal.
#[allow(clippy::too_many_arguments)]
async fn held_call(
    cfg: Arc<ProxyConfig>,
    up: Up,
    call: crate::call::ToolCall,
    d: Decision,
    msg: Value,
    id: Value,
    token: Option<Value>,
    limits: McpLimits,
    tx: mpsc::Sender<Bytes>,
) {
    let wait = hold(&cfg, &call, &d, None);
    tokio::pin!(wait);
    let mut tick = tokio::time::interval(limits.progress_every);
    tick.tick().await;
    let mut n = 0u64;
    let held = loop {
        tokio::select! {
            h = &mut wait => break h,
            _ = tick.tick() => {
                n += 1;
                up.touch();
                let b = match &token {
                    Some(t) => rpc::sse_event(&rpc::progress(t, n, "waiting for approval")),
                    None => Bytes::from_static(b": waiting for approval\n\n"),
                };
                // The client went away: the approval stays pending, the
                // call is not run.
                if tx.send(b).await.is_err() {
                    return;
                }
            }
        }
    };
    let reply = match held {
        Held::Approved => match up.send(&msg, Some(&id), token).await {
            Ok(x) => {
                x.pump(&id, limits.call_timeout, &tx).await;
                return;
            }
            Err(e) => e.message(&id),
        },
        Held::Refused(aid) => denial(&id, &d, aid.as_deref()),
        Held::Unaudited => unaudited(&id),
    };
    let _ = tx.send(rpc::sse_event(&reply)).await;
}

fn denial(id: &Value, d: &Decision, approval: Option<&str>) -> Value {
    rpc::error(
        id,
        rpc::POLICY_DENIED,
        &format!("refused by policy: {}", d.reason),
        Some(json!({
            "error": "policy_denied",
            "rule": d.rule_id,
            "layer": d.layer.map(|l| l.as_str()),
            "reason": d.reason,
            "approval_id": approval,
        })),
    )
}

fn unaudited(id: &Value) -> Value {
    rpc::error(
        id,
        rpc::POLICY_DENIED,
        "the decision could not be written to the audit log; call refused",
        Some(json!({ "error": "audit_unavailable" })),
    )
}

fn header_str(req: &Request<Incoming>, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(str::to_string)
}

fn plain(status: StatusCode, msg: &str) -> Response<Body> {
    json_reply(status, &json!({ "error": msg }), None)
}

fn set_session(r: &mut Response<Body>, session: Option<&str>) {
    if let Some(v) = session.and_then(|s| HeaderValue::from_str(s).ok()) {
        r.headers_mut().insert(SESSION_HEADER, v);
    }
}

fn json_reply(status: StatusCode, v: &Value, session: Option<&str>) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    set_session(&mut r, session);
    r
}

/// A response body fed from a channel.
struct ChanBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChanBody {
    type Data = Bytes;
    type Error = hyper::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

fn sse_response(rx: mpsc::Receiver<Bytes>, session: Option<&str>) -> Response<Body> {
    let mut r = Response::new(ChanBody(rx).boxed());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    set_session(&mut r, session);
    r
}

/// Why an upstream exchange failed.
struct UpErr {
    status: StatusCode,
    reason: String,
}

impl UpErr {
    fn new(status: StatusCode, reason: impl Into<String>) -> Self {
        UpErr {
            status,
            reason: reason.into(),
        }
    }
    fn message(&self, id: &Value) -> Value {
        rpc::error(id, rpc::UPSTREAM_ERROR, &self.reason, None)
    }
    fn reply(&self, id: &Value) -> Response<Body> {
        json_reply(self.status, &self.message(id), None)
    }
}

/// One message's way to a connector's server.
struct Up {
    cfg: Arc<ProxyConfig>,
    gw: Arc<McpGateway>,
    /// The connector is the platform layer's (trusted with host commands
    /// and private addresses).
    platform: bool,
    conn: Connector,
    session: Option<String>,
    version: Option<String>,
}

/// The server's answer to one message: its messages (notifications, then
/// the response) and the session it belongs to.
struct Exchange {
    session: Option<String>,
    rx: Option<mpsc::UnboundedReceiver<Value>>,
}

impl Up {
    /// Marks this message's stdio session as in use.
    fn touch(&self) {
        if let Some(s) = self
            .session
            .as_ref()
            .and_then(|s| self.gw.lock().get(s).map(|x| x.server.clone()))
        {
            s.touch();
        }
    }

    async fn send(
        &self,
        msg: &Value,
        id: Option<&Value>,
        token: Option<Value>,
    ) -> Result<Exchange, UpErr> {
        let Some(server) = &self.conn.mcp else {
            return Err(UpErr::new(StatusCode::NOT_FOUND, "not an MCP connector"));
        };
        match &server.upstream {
            McpUpstream::Http { url, .. } => self.send_http(url, server, msg, id).await,
            McpUpstream::Stdio { command, .. } => {
                self.send_stdio(command, server, msg, id, token).await
            }
        }
    }

    async fn send_stdio(
        &self,
        command: &[String],
        server: &McpServer,
        msg: &Value,
        id: Option<&Value>,
        token: Option<Value>,
    ) -> Result<Exchange, UpErr> {
        if !self.platform && !self.gw.limits.tenant_stdio {
            return Err(UpErr::new(
                StatusCode::FORBIDDEN,
                format!(
                    "connector `{}` runs a host command and is declared by the tenant policy; only the platform policy may declare stdio MCP servers here (`[security] mcp_tenant_stdio`)",
                    self.conn.name
                ),
            ));
        }
        let initialize = msg.get("method").and_then(Value::as_str) == Some("initialize");
        // Resolved before the session table is locked (a secret may be an
        // OAuth2 token the broker fetches).
        let env = if initialize && self.session.is_none() {
            Some(
                credentials(&self.cfg, &self.conn.name, server)
                    .await
                    .map_err(|e| UpErr::new(StatusCode::BAD_GATEWAY, e))?,
            )
        } else {
            None
        };
        let (sid, srv) = if let Some(env) = env {
            let mut g = self.gw.lock();
            let n = g
                .values()
                .filter(|s| s.connector == self.conn.name && s.server.is_alive())
                .count();
            if n >= self.gw.limits.sessions_per_connector {
                return Err(UpErr::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "connector `{}` already has {n} sessions in this sandbox (the limit); end one with DELETE",
                        self.conn.name
                    ),
                ));
            }
            let srv = StdioServer::spawn(command, &env).map_err(|e| {
                UpErr::new(
                    StatusCode::BAD_GATEWAY,
                    format!("starting the stdio MCP server of `{}`: {e}", self.conn.name),
                )
            })?;
            let sid = uuid::Uuid::new_v4().simple().to_string();
            g.insert(
                sid.clone(),
                Session {
                    connector: self.conn.name.clone(),
                    command: command.to_vec(),
                    server: srv.clone(),
                },
            );
            (sid, srv)
        } else {
            let Some(sid) = &self.session else {
                return Err(UpErr::new(
                    StatusCode::BAD_REQUEST,
                    "no Mcp-Session-Id: initialize first",
                ));
            };
            let g = self.gw.lock();
            match g.get(sid) {
                Some(s)
                    if s.connector == self.conn.name
                        && s.command == command
                        && s.server.is_alive() =>
                {
                    (sid.clone(), s.server.clone())
                }
                _ => {
                    return Err(UpErr::new(
                        StatusCode::NOT_FOUND,
                        "unknown or ended MCP session; initialize again",
                    ))
                }
            }
        };
        let rx = match id {
            Some(id) => Some(srv.request(id, token, msg).await),
            None => {
                srv.write(msg).await.map(|_| ()).map_err(|e| {
                    UpErr::new(StatusCode::BAD_GATEWAY, format!("stdio server: {e}"))
                })?;
                None
            }
        };
        let rx = match rx {
            Some(Ok(rx)) => Some(rx),
            Some(Err(e)) => {
                return Err(UpErr::new(
                    StatusCode::BAD_GATEWAY,
                    format!("stdio server: {e}"),
                ))
            }
            None => None,
        };
        Ok(Exchange {
            session: Some(sid),
            rx,
        })
    }

    async fn send_http(
        &self,
        url: &str,
        server: &McpServer,
        msg: &Value,
        id: Option<&Value>,
    ) -> Result<Exchange, UpErr> {
        let bad = |why: String| UpErr::new(StatusCode::BAD_GATEWAY, why);
        let uri: hyper::Uri = url.parse().map_err(|_| bad("bad upstream url".into()))?;
        let host = uri
            .host()
            .ok_or_else(|| bad("upstream url without host".into()))?;
        let https = uri.scheme_str() == Some("https");
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let addrs: Vec<std::net::SocketAddr> =
            tokio::net::lookup_host((host.trim_matches(['[', ']']), port))
                .await
                .map_err(|e| bad(format!("resolving {host}: {e}")))?
                .collect();
        let addrs: Vec<_> = if self.platform || self.gw.limits.tenant_private_urls {
            addrs
        } else {
            addrs
                .into_iter()
                .filter(|a| super::upstream::is_public(a.ip()))
                .collect()
        };
        if addrs.is_empty() {
            return Err(UpErr::new(
                StatusCode::FORBIDDEN,
                format!("`{host}` has no public address; a tenant's MCP connector may not reach the host's networks (`[security] mcp_tenant_private_urls`)"),
            ));
        }
        let sock = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::net::TcpStream::connect(&addrs[..]),
        )
        .await
        .map_err(|_| bad(format!("connecting to {host}:{port} timed out")))?
        .map_err(|e| bad(format!("connecting to {host}:{port}: {e}")))?;
        let _ = sock.set_nodelay(true);
        let mut b = Request::post(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
            .header(
                header::HOST,
                uri.authority().map(|a| a.as_str()).unwrap_or(host),
            )
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, text/event-stream");
        let creds = credentials(&self.cfg, &self.conn.name, server)
            .await
            .map_err(|e| UpErr::new(StatusCode::BAD_GATEWAY, e))?;
        for (k, v) in creds {
            b = b.header(k, v);
        }
        if let Some(s) = &self.session {
            b = b.header(SESSION_HEADER, s);
        }
        if let Some(v) = &self.version {
            b = b.header(VERSION_HEADER, v);
        }
        let req = b
            .body(full(msg.to_string()))
            .map_err(|e| bad(format!("upstream request: {e}")))?;
        let resp = if https {
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|_| bad("not a TLS server name".into()))?;
            let tls = tokio_rustls::TlsConnector::from(upstream_tls())
                .connect(name, sock)
                .await
                .map_err(|e| bad(format!("TLS to {host}: {e}")))?;
            send_on(TokioIo::new(tls), req).await?
        } else {
            send_on(TokioIo::new(sock), req).await?
        };
        let session = resp
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .or_else(|| self.session.clone());
        let status = resp.status();
        if !status.is_success() {
            return Err(UpErr::new(
                if status == StatusCode::NOT_FOUND {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::BAD_GATEWAY
                },
                format!("the MCP server answered HTTP {status}"),
            ));
        }
        if id.is_none() || status == StatusCode::ACCEPTED {
            return Ok(Exchange { session, rx: None });
        }
        let sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("text/event-stream"));
        let (tx, rx) = mpsc::unbounded_channel();
        let mut body = resp.into_body();
        tokio::spawn(async move {
            let mut buf: Vec<u8> = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buf.extend_from_slice(&data);
                if !sse {
                    if buf.len() > rpc::MAX_UPSTREAM_MESSAGE {
                        return;
                    }
                    continue;
                }
                while let Some(ev) = rpc::sse_take_event(&mut buf) {
                    match ev {
                        Err(()) => return,
                        Ok(None) => {}
                        Ok(Some(data)) => {
                            if let Ok(v) = serde_json::from_str::<Value>(&data) {
                                if tx.send(v).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                }
            }
            if !sse {
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    let _ = tx.send(v);
                }
            }
        });
        Ok(Exchange {
            session,
            rx: Some(rx),
        })
    }
}

async fn send_on<I>(io: I, req: Request<Body>) -> Result<Response<Incoming>, UpErr>
where
    I: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
{
    let bad = |why: String| UpErr::new(StatusCode::BAD_GATEWAY, why);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| bad(format!("upstream: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
        .send_request(req)
        .await
        .map_err(|e| bad(format!("upstream: {e}")))
}

/// TLS trust for `https://` MCP servers: the system's roots.
fn upstream_tls() -> Arc<rustls::ClientConfig> {
    static CFG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    CFG.get_or_init(|| {
        let mut roots = rustls::RootCertStore::empty();
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| b.with_root_certificates(roots).with_no_client_auth())
            .unwrap_or_else(|_| {
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth()
            });
        Arc::new(cfg)
    })
    .clone()
}

fn is_response_to(v: &Value, id: &Value) -> bool {
    v.get("method").is_none() && v.get("id") == Some(id)
}

impl Exchange {
    /// Waits for the response to `id` (dropping notifications), edits it
    /// with `edit`, answers it as JSON.
    async fn collect(
        self,
        id: &Value,
        timeout: Duration,
        edit: impl FnOnce(&mut Value),
    ) -> Response<Body> {
        let session = self.session.clone();
        let Some(mut rx) = self.rx else {
            return json_reply(
                StatusCode::BAD_GATEWAY,
                &rpc::error(id, rpc::UPSTREAM_ERROR, "no answer", None),
                session.as_deref(),
            );
        };
        let got = tokio::time::timeout(timeout, async {
            while let Some(v) = rx.recv().await {
                if is_response_to(&v, id) {
                    return Some(v);
                }
            }
            None
        })
        .await;
        match got {
            Ok(Some(mut v)) => {
                edit(&mut v);
                json_reply(StatusCode::OK, &v, session.as_deref())
            }
            Ok(None) => json_reply(
                StatusCode::BAD_GATEWAY,
                &rpc::error(
                    id,
                    rpc::UPSTREAM_ERROR,
                    "the MCP server ended without answering",
                    None,
                ),
                session.as_deref(),
            ),
            Err(_) => json_reply(
                StatusCode::GATEWAY_TIMEOUT,
                &rpc::error(
                    id,
                    rpc::UPSTREAM_ERROR,
                    "the MCP server did not answer in time",
                    None,
                ),
                session.as_deref(),
            ),
        }
    }

    /// Answers as an SSE stream of the server's messages, up to the response.
    fn stream(self, id: Value, timeout: Duration) -> Response<Body> {
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let session = self.session.clone();
        tokio::spawn(async move { self.pump(&id, timeout, &tx).await });
        sse_response(rx, session.as_deref())
    }

    /// Copies the server's messages to `tx` as SSE events, up to the
    /// response to `id` (or an error when none comes).
    async fn pump(self, id: &Value, timeout: Duration, tx: &mpsc::Sender<Bytes>) {
        let Some(mut rx) = self.rx else { return };
        let done = tokio::time::timeout(timeout, async {
            while let Some(v) = rx.recv().await {
                let last = is_response_to(&v, id);
                if tx.send(rpc::sse_event(&v)).await.is_err() || last {
                    return true;
                }
            }
            false
        })
        .await;
        if done != Ok(true) {
            let e = rpc::error(
                id,
                rpc::UPSTREAM_ERROR,
                "the MCP server did not answer",
                None,
            );
            let _ = tx.send(rpc::sse_event(&e)).await;
        }
    }
}
